from django.urls import path

from gateway import economics_api

urlpatterns = [
    path("fleet/economics", economics_api.FleetEconomicsApi.as_view(), name="api-fleet-economics"),
    path("fleet/break-even", economics_api.BreakEvenApi.as_view(), name="api-fleet-break-even"),
    path("fleet/capacity", economics_api.CapacityApi.as_view(), name="api-fleet-capacity"),
]
