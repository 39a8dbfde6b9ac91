"""Management API for the caller's tenant's keys."""

from datetime import timedelta

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.response import Response

from apikeys import selectors, services
from apikeys.models import ApiKey, Scope
from apikeys.serializers import (
    ApiKeyCreatedOutput,
    ApiKeyCreateInput,
    ApiKeyLimitsInput,
    ApiKeyOutput,
    ApiKeyRotateInput,
)
from quilt.pagination import StrictLimitOffsetPagination
from tenancy.api_base import TenantAPIView
from tenancy.models import Membership

Role = Membership.Role


class _KeysApi(TenantAPIView):
    required_roles = {"GET": Role.VIEWER, "POST": Role.DEVELOPER}
    required_scopes = {"GET": Scope.ADMIN, "POST": Scope.ADMIN}

    def _key(self, key_id: str) -> ApiKey:
        return get_object_or_404(selectors.api_keys_of(tenant=self.tenant), prefix=key_id)


class ApiKeyListApi(_KeysApi):
    pagination_class = StrictLimitOffsetPagination

    @extend_schema(responses=ApiKeyOutput(many=True))
    def get(self, request):
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(selectors.api_keys_of(tenant=self.tenant), request, view=self)
        return paginator.get_paginated_response(ApiKeyOutput(page, many=True).data)

    @extend_schema(request=ApiKeyCreateInput, responses={201: ApiKeyCreatedOutput})
    def post(self, request):
        data = ApiKeyCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        key, plaintext = services.api_key_create(actor=self.actor, tenant=self.tenant, **data.validated_data)
        body = ApiKeyCreatedOutput(key, context={"plaintext": plaintext}).data
        return Response(body, status=status.HTTP_201_CREATED)


class ApiKeyDetailApi(_KeysApi):
    @extend_schema(responses=ApiKeyOutput)
    def get(self, request, key_id: str):
        return Response(ApiKeyOutput(self._key(key_id)).data)


class ApiKeyRevokeApi(_KeysApi):
    @extend_schema(request=None, responses=ApiKeyOutput)
    def post(self, request, key_id: str):
        key = services.api_key_revoke(actor=self.actor, key=self._key(key_id))
        return Response(ApiKeyOutput(key).data)


class ApiKeyRotateApi(_KeysApi):
    @extend_schema(request=ApiKeyRotateInput, responses={201: ApiKeyCreatedOutput})
    def post(self, request, key_id: str):
        old = self._key(key_id)
        data = ApiKeyRotateInput(data=request.data)
        data.is_valid(raise_exception=True)
        grace = timedelta(seconds=data.validated_data["grace_seconds"])
        new, plaintext = services.api_key_rotate(actor=self.actor, key=old, grace=grace)
        return Response(ApiKeyCreatedOutput(new, context={"plaintext": plaintext}).data, status=201)


class ApiKeyLimitsApi(_KeysApi):
    required_roles = {"PUT": Role.ADMIN}
    required_scopes = {"PUT": Scope.ADMIN}

    @extend_schema(
        request=ApiKeyLimitsInput, responses=ApiKeyOutput, summary="Set a key's own budget and rate limits",
        description="Replaces the key's monthly budget and RPM/TPM limits (null: none of its own). They are checked "
        "with the tenant's on every request, atomically, and apply within a second. Needs the admin role.",
    )  # fmt: skip
    def put(self, request, key_id: str):
        key = self._key(key_id)
        data = ApiKeyLimitsInput(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(ApiKeyOutput(services.api_key_limits_set(actor=self.actor, key=key, **data.validated_data)).data)
