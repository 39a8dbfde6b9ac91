"""Usage of the caller's tenant, grouped by day, model or key, as JSON or CSV."""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from apikeys.models import Scope
from metering.renderers import CsvRenderer
from metering.selectors import usage_grouped, usage_sum
from metering.serializers import UsageOutput, UsageQueryInput, UsageRowOutput
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
