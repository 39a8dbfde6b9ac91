from django.urls import path

from registry import api

urlpatterns = [
    path("base-models", api.BaseModelListApi.as_view(), name="api-base-models"),
    path("adapters", api.AdapterListApi.as_view(), name="api-adapters"),
    path("adapters/<str:name>", api.AdapterDetailApi.as_view(), name="api-adapter"),
    path("adapters/<str:name>/versions", api.AdapterVersionListApi.as_view(), name="api-adapter-versions"),
    path("adapters/<str:name>/promote", api.AdapterPromoteApi.as_view(), name="api-adapter-promote"),
    path("adapters/<str:name>/rollback", api.AdapterRollbackApi.as_view(), name="api-adapter-rollback"),
    path("adapters/<str:name>/warm", api.AdapterWarmApi.as_view(), name="api-adapter-warm"),
]
