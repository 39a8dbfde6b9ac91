from django.urls import path

from metering import api

urlpatterns = [
    path("usage", api.UsageApi.as_view(), name="api-usage"),
    path("usage.csv", api.UsageApi.as_view(), {"format": "csv"}, name="api-usage-csv"),
]
