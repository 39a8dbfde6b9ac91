from django.urls import path

from apikeys import api

urlpatterns = [
    path("keys", api.ApiKeyListApi.as_view(), name="api-keys"),
    path("keys/<str:key_id>", api.ApiKeyDetailApi.as_view(), name="api-key"),
    path("keys/<str:key_id>/revoke", api.ApiKeyRevokeApi.as_view(), name="api-key-revoke"),
    path("keys/<str:key_id>/rotate", api.ApiKeyRotateApi.as_view(), name="api-key-rotate"),
    path("keys/<str:key_id>/limits", api.ApiKeyLimitsApi.as_view(), name="api-key-limits"),
]
