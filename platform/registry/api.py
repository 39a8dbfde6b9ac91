"""Management API for the caller's adapters: upload, versions, promote / rollback, delete; and base models.

Reads need any valid key (or the viewer role); writes need the `adapters:write` scope (or developer).
"""

from django.conf import settings
from django.http import Http404
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions, status
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response

from apikeys.models import Scope
from quilt.pagination import StrictLimitOffsetPagination
from quilt.parsers import QuiltJSONParser
from quilt.schema import ErrorOutput
from registry import promotion, selectors, services
from registry.errors import RegistryRefusal, UploadTooLarge
from registry.models import Adapter
from registry.serializers import (
    AdapterCreatedOutput,
    AdapterCreateInput,
    AdapterDetailOutput,
    AdapterOutput,
    AdapterPromoteInput,
    AdapterVersionCreateInput,
    AdapterVersionOutput,
    AdapterWarmInput,
    BaseModelOutput,
)
from registry.upload_handlers import CappedTemporaryFileUploadHandler
from tenancy.api_base import TenantAPIView
from tenancy.models import Membership

Role = Membership.Role
MULTIPART_OVERHEAD_BYTES = 64 * 1024
UPLOAD_REFUSED = OpenApiResponse(
    ErrorOutput,
    description="The body has the schema's shape but its file is not an adapter this platform can serve: a pickle "
    "file, an image, an archive that does not unpack, two files of one name, no adapter_config.json, weights for "
    "modules the base model lacks, an empty file (the code says which); or the base model does not exist.",
)


class _RegistryApi(TenantAPIView):
    required_roles = {"GET": Role.VIEWER, "POST": Role.DEVELOPER, "DELETE": Role.DEVELOPER}
    required_scopes = {"GET": "", "POST": Scope.ADAPTERS_WRITE, "DELETE": Scope.ADAPTERS_WRITE}

    def handle_exception(self, exc):
        if isinstance(exc, RegistryRefusal):
            refusal = exceptions.APIException(detail=exc.message, code=exc.code)
            refusal.status_code = exc.status_code
            exc = refusal
        return super().handle_exception(exc)

    def _adapter(self, name: str) -> Adapter:
        adapter = selectors.adapter_get(tenant=self.tenant, name=name)
        if adapter is None:
            raise Http404
        return adapter

    def initialize_request(self, request, *args, **kwargs):
        """Before anything reads the body (a session's CSRF check may): stream file parts to disk, capped."""
        if request.method == "POST":
            cap = settings.QUILT_MAX_UPLOAD_BYTES
            refusal = UploadTooLarge(
                f"The upload is too large; this platform allows at most {services.human_bytes(cap)} per adapter.",
                code="adapter_too_large",
            )
            request.upload_handlers = [CappedTemporaryFileUploadHandler(request, cap=cap, refusal=refusal)]
        return super().initialize_request(request, *args, **kwargs)

    def _stream_uploads(self, request) -> None:
        """Once the tenant is known: refuse an announced oversize body, and tighten the cap to its plan."""
        cap = services.upload_limit(tenant=self.tenant)
        announced = int(request.META.get("CONTENT_LENGTH") or 0)
        if announced > cap + MULTIPART_OVERHEAD_BYTES:
            raise services.upload_refusal(tenant=self.tenant, size=announced)
        (handler,) = request.upload_handlers  # a body read already (a session's CSRF check) kept the global cap
        handler.cap, handler.refusal = cap, services.upload_refusal(tenant=self.tenant)


class BaseModelListApi(_RegistryApi):
    @extend_schema(responses=BaseModelOutput(many=True))
    def get(self, request):
        return Response(BaseModelOutput(selectors.base_models_active(), many=True).data)


class AdapterListApi(_RegistryApi):
    parser_classes = [QuiltJSONParser, MultiPartParser]  # the upload's files are multipart
    pagination_class = StrictLimitOffsetPagination  # strict ?limit=/?offset=, and the schema shows the page

    @extend_schema(responses=AdapterOutput(many=True))
    def get(self, request):
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(selectors.adapters_of(tenant=self.tenant), request, view=self)
        return paginator.get_paginated_response(AdapterOutput(page, many=True).data)

    @extend_schema(
        request={"multipart/form-data": AdapterCreateInput}, responses={201: AdapterCreatedOutput, 422: UPLOAD_REFUSED}
    )
    def post(self, request):
        self._stream_uploads(request)
        data = AdapterCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        adapter = services.adapter_create(
            actor=self.actor, tenant=self.tenant, name=fields["name"], base_model=fields["base_model"],
            description=fields["description"], files=fields["file"],
        )  # fmt: skip
        return Response(AdapterCreatedOutput(adapter).data, status=status.HTTP_201_CREATED)


class AdapterDetailApi(_RegistryApi):
    @extend_schema(responses=AdapterDetailOutput)
    def get(self, request, name: str):
        return Response(AdapterDetailOutput(self._adapter(name)).data)

    @extend_schema(responses={204: None})
    def delete(self, request, name: str):
        services.adapter_delete(actor=self.actor, adapter=self._adapter(name))
        return Response(status=status.HTTP_204_NO_CONTENT)


class AdapterVersionListApi(_RegistryApi):
    parser_classes = [QuiltJSONParser, MultiPartParser]
    @extend_schema(responses=AdapterVersionOutput(many=True))
    def get(self, request, name: str):
        versions = selectors.adapter_versions(adapter=self._adapter(name)).select_related("created_by")
        return Response(AdapterVersionOutput(versions, many=True).data)

    @extend_schema(
        request={"multipart/form-data": AdapterVersionCreateInput},
        responses={201: AdapterVersionOutput, 422: UPLOAD_REFUSED},
    )
    def post(self, request, name: str):
        adapter = self._adapter(name)
        self._stream_uploads(request)
        data = AdapterVersionCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        version = services.adapter_version_create(actor=self.actor, adapter=adapter, files=data.validated_data["file"])
        return Response(AdapterVersionOutput(version).data, status=status.HTTP_201_CREATED)


class AdapterPromoteApi(_RegistryApi):
    @extend_schema(request=AdapterPromoteInput, responses=AdapterDetailOutput)
    def post(self, request, name: str):
        adapter = self._adapter(name)
        data = AdapterPromoteInput(data=request.data)
        data.is_valid(raise_exception=True)
        adapter = promotion.adapter_promote(
            actor=self.actor, adapter=adapter, version_number=data.validated_data["version"]
        )
        return Response(AdapterDetailOutput(adapter).data)


class AdapterRollbackApi(_RegistryApi):
    @extend_schema(request=None, responses=AdapterDetailOutput)
    def post(self, request, name: str):
        adapter = promotion.adapter_rollback(actor=self.actor, adapter=self._adapter(name))
        return Response(AdapterDetailOutput(adapter).data)


class AdapterWarmApi(_RegistryApi):
    @extend_schema(request=AdapterWarmInput, responses=AdapterDetailOutput)
    def post(self, request, name: str):
        adapter = self._adapter(name)
        data = AdapterWarmInput(data=request.data)
        data.is_valid(raise_exception=True)
        adapter = services.adapter_warm_set(actor=self.actor, adapter=adapter, tier=data.validated_data["tier"])
        return Response(AdapterDetailOutput(adapter).data)
