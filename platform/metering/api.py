"""Usage of the caller's tenant, grouped by day, model or key, as JSON or CSV."""

from django.http import Http404, StreamingHttpResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.exceptions import NotFound
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from apikeys.models import Scope
from metering.renderers import CsvRenderer
from metering.request_log import BadCursor, LogFilters, request_detail, request_log_page
from metering.request_log_csv import request_log_csv, since_instant, until_instant
from metering.selectors import usage_grouped, usage_sum
from metering.serializers import (
    RequestLogPageOutput,
    RequestLogQueryInput,
    RequestLogRowOutput,
    UsageOutput,
    UsageQueryInput,
    UsageRowOutput,
)
from tenancy.api_base import TenantAPIView
from tenancy.models import Membership

CSV_COLUMNS = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "price"]


class UsageApi(TenantAPIView):
    required_roles = {"GET": Membership.Role.VIEWER}
    required_scopes = {"GET": Scope.USAGE_READ}
    renderer_classes = [JSONRenderer, CsvRenderer]

    @extend_schema(
        parameters=[UsageQueryInput],
        responses={
            200: OpenApiResponse(UsageOutput, description="JSON, or CSV rows with ?format=csv / usage.csv")
        },
    )
    def get(self, request, format=None):
        query = UsageQueryInput(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        rows = usage_grouped(
            tenant=self.tenant, since=params["start"], until=params["end"], group_by=params["group_by"]
        )
        if request.accepted_renderer.format == "csv":
            self.csv_header = [params["group_by"], *CSV_COLUMNS]
            body = [{params["group_by"]: row["group"], **{name: row[name] for name in CSV_COLUMNS}}
                    for row in UsageRowOutput(rows, many=True).data]  # fmt: skip
            filename = f"usage-{self.tenant.slug}-{params['start']}-{params['end']}-{params['group_by']}.csv"
            return Response(body, headers={"Content-Disposition": f'attachment; filename="{filename}"'})
        return Response(UsageOutput({**params, "data": rows, "total": usage_sum(rows)}).data)


class RequestLogApi(TenantAPIView):
    required_roles = {"GET": Membership.Role.VIEWER}
    required_scopes = {"GET": Scope.USAGE_READ}
    renderer_classes = [JSONRenderer, CsvRenderer]

    @extend_schema(
        parameters=[RequestLogQueryInput], summary="List requests (the request log)",
        description="The caller's tenant's requests, one row each with key, model, adapter version, status (refusals "
        "included: 400, 404, 429 ... with their status and error code), tokens, time to first token and latency "
        "(from the gateway's receipt, the engine's own beside them) and cost; filtered, sorted, and paged by cursor "
        "(pass `next_cursor` back as `?cursor=`). Metadata only. `requests.csv` (or `?format=csv`) streams every "
        "row the filters match, in the sort's order, with the console's Export CSV columns (cursor and limit do "
        "not apply).",
        responses={200: OpenApiResponse(RequestLogPageOutput, description="JSON, or CSV rows with ?format=csv")},
    )  # fmt: skip
    def get(self, request, format=None):
        query = RequestLogQueryInput(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        filters = LogFilters(key_prefix=params["key"], adapter=params["adapter"], model=params["model"],
                             status=params["status"], since=since_instant(params["since"]),
                             until=until_instant(params["until"]))  # fmt: skip
        if request.accepted_renderer.format == "csv":
            lines = request_log_csv(tenant=self.tenant, filters=filters, sort=params["sort"])
            response = StreamingHttpResponse(lines, content_type="text/csv; charset=utf-8")
            response["Content-Disposition"] = f'attachment; filename="{self.tenant.slug}-requests.csv"'
            return response
        try:
            page = request_log_page(tenant=self.tenant, filters=filters, sort=params["sort"], cursor=params["cursor"],
                                    limit=params["limit"])  # fmt: skip
        except BadCursor as error:  # (DRF's own cursor pagination answers a cursor it did not give out 404 too)
            raise NotFound(f"cursor: {error}", code="invalid_cursor") from None
        return Response({"data": RequestLogRowOutput(page.rows, many=True).data, "next_cursor": page.next_cursor})


class RequestDetailApi(TenantAPIView):
    required_roles = {"GET": Membership.Role.VIEWER}
    required_scopes = {"GET": Scope.USAGE_READ}

    @extend_schema(
        operation_id="v1_request_retrieve", responses=RequestLogRowOutput, summary="Get one request",
        description="One request of the caller's tenant, by the id its response carried (x-request-id).",
    )  # fmt: skip
    def get(self, request, request_id: str):
        found = request_detail(tenant=self.tenant, request_id=request_id, reader=self.actor)
        if found is None:
            raise Http404("No such request.")
        return Response(RequestLogRowOutput(found[0]).data)
