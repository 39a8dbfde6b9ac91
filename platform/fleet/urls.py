from django.urls import path

from fleet import api

urlpatterns = [
    path("fleet/economics", api.FleetEconomicsApi.as_view(), name="api-fleet-economics"),
    path("fleet/break-even", api.BreakEvenApi.as_view(), name="api-fleet-break-even"),
    path("fleet/capacity", api.CapacityApi.as_view(), name="api-fleet-capacity"),
]
