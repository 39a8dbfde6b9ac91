from django.urls import path

from metering import api

urlpatterns = [
    path("usage", api.UsageApi.as_view(), name="api-usage"),
    path("usage.csv", api.UsageApi.as_view(), {"format": "csv"}, name="api-usage-csv"),
    path("requests", api.RequestLogApi.as_view(), name="api-requests"),
    path("requests.csv", api.RequestLogApi.as_view(), {"format": "csv"}, name="api-requests-csv"),
    path("requests/<str:request_id>", api.RequestDetailApi.as_view(), name="api-request"),
]
