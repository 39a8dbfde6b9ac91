"""Management API for the caller's tenant and its members, and staff-only tenants, plans and audit log."""

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import permissions, status
from rest_framework.authentication import SessionAuthentication
from rest_framework.response import Response
from rest_framework.views import APIView

from apikeys.models import Scope
from quilt.pagination import StrictLimitOffsetPagination
from tenancy import invitations, selectors, services
from tenancy.api_base import StaffAPIView, TenantAPIView
from tenancy.models import Membership, Plan, Tenant
from tenancy.serializers import (
    AuditLogOutput,
    AuditLogQueryInput,
    InvitationAcceptInput,
    InvitationCreatedOutput,
    InvitationOutput,
    InvitationPublicOutput,
    MemberCreateInput,
    MemberOutput,
    MemberUpdateInput,
    PlanInput,
    PlanOutput,
    StaffAuditLogQueryInput,
    TenantAuditLogOutput,
    TenantCreateInput,
    TenantListQueryInput,
    TenantOutput,
    TenantSettingsInput,
    TenantUpdateInput,
    WebhookSecretInput,
    WebhookSecretOutput,
)

Role = Membership.Role


def _page(view, request, queryset, serializer_class):
    paginator = view.pagination_class()
    page = paginator.paginate_queryset(queryset, request, view=view)
    return paginator.get_paginated_response(serializer_class(page, many=True).data)


class OwnTenantApi(TenantAPIView):
    required_roles = {"GET": Role.VIEWER, "PATCH": Role.ADMIN}
    required_scopes = {"GET": "", "PATCH": Scope.ADMIN}
    billing_methods = frozenset({"PATCH"})  # the billing e-mail; the service refuses the rest while suspended

    @extend_schema(responses=TenantOutput)
    def get(self, request):
        return Response(TenantOutput(self.tenant).data)

    @extend_schema(request=TenantSettingsInput, responses=TenantOutput)
    def patch(self, request):
        data = TenantSettingsInput(data=request.data)
        data.is_valid(raise_exception=True)
        tenant = services.tenant_settings_update(actor=self.actor, tenant=self.tenant, changes=data.validated_data)
        return Response(TenantOutput(tenant).data)


class WebhookSecretApi(TenantAPIView):
    required_roles = {"POST": Role.ADMIN}
    required_scopes = {"POST": Scope.ADMIN}

    @extend_schema(request=WebhookSecretInput, responses=WebhookSecretOutput)
    def post(self, request):
        """Sets (or, with no `secret`, generates) the secret budget-alert webhooks are signed with."""
        data = WebhookSecretInput(data=request.data)
        data.is_valid(raise_exception=True)
        secret = services.tenant_webhook_secret_set(actor=self.actor, tenant=self.tenant, **data.validated_data)
        return Response(WebhookSecretOutput({"webhook_secret": secret}).data)


class OwnAuditLogApi(TenantAPIView):
    """The caller's tenant's audit log, newest first; ?action= (prefix) and ?actor= (username) filter it."""

    required_roles = {"GET": Role.ADMIN}
    required_scopes = {"GET": Scope.ADMIN}
    pagination_class = StrictLimitOffsetPagination
    query_input = AuditLogQueryInput

    @extend_schema(parameters=[AuditLogQueryInput], responses=TenantAuditLogOutput(many=True))
    def get(self, request):
        query = self.query_input(data=request.query_params)
        query.is_valid(raise_exception=True)
        rows = selectors.audit_log_list(tenant=self.tenant, **query.validated_data)
        return _page(self, request, rows, TenantAuditLogOutput)


class MemberListApi(TenantAPIView):
    pagination_class = StrictLimitOffsetPagination
    required_roles = {"GET": Role.VIEWER, "POST": Role.ADMIN}
    required_scopes = {"GET": Scope.ADMIN, "POST": Scope.ADMIN}

    @extend_schema(responses=MemberOutput(many=True))
    def get(self, request):
        return _page(self, request, selectors.members_of(tenant=self.tenant), MemberOutput)

    @extend_schema(request=MemberCreateInput, responses={201: InvitationCreatedOutput})
    def post(self, request):
        """Invites an e-mail address; the answer carries the link (also e-mailed) that the invitee accepts."""
        data = MemberCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        invitation, link = invitations.invitation_create(actor=self.actor, tenant=self.tenant, **data.validated_data)
        return Response(InvitationCreatedOutput(invitation, context={"link": link}).data, status=201)


class InvitationListApi(TenantAPIView):
    pagination_class = StrictLimitOffsetPagination
    required_roles = {"GET": Role.ADMIN}
    required_scopes = {"GET": Scope.ADMIN}

    @extend_schema(responses=InvitationOutput(many=True))
    def get(self, request):
        return _page(self, request, selectors.invitations_of(tenant=self.tenant), InvitationOutput)


class InvitationRevokeApi(TenantAPIView):
    required_roles = {"POST": Role.ADMIN}
    required_scopes = {"POST": Scope.ADMIN}

    @extend_schema(request=None, responses=InvitationOutput)
    def post(self, request, invitation_id: int):
        invitation = get_object_or_404(selectors.invitations_of(tenant=self.tenant), pk=invitation_id)
        return Response(InvitationOutput(invitations.invitation_revoke(actor=self.actor, invitation=invitation)).data)


class InvitationAcceptApi(APIView):
    """Opened from the invitation link: GET shows what it offers; POST accepts it, into the logged-in account or
    a new one. The token in the link is the credential; a wrong or used one reads the same as an expired one."""

    permission_classes = [permissions.AllowAny]
    authentication_classes = [SessionAuthentication]

    @extend_schema(responses=InvitationPublicOutput)
    def get(self, request, token: str):
        return Response(InvitationPublicOutput(invitations.invitation_pending(token=token)).data)

    @extend_schema(request=InvitationAcceptInput, responses={201: MemberOutput})
    def post(self, request, token: str):
        data = InvitationAcceptInput(data=request.data)
        data.is_valid(raise_exception=True)
        user = request.user if request.user.is_authenticated else None
        membership = invitations.invitation_accept(token=token, user=user, **data.validated_data)
        return Response(MemberOutput(membership).data, status=status.HTTP_201_CREATED)


class MemberDetailApi(TenantAPIView):
    required_roles = {"GET": Role.VIEWER, "PATCH": Role.ADMIN, "DELETE": Role.ADMIN}
    required_scopes = {"GET": Scope.ADMIN, "PATCH": Scope.ADMIN, "DELETE": Scope.ADMIN}

    def _membership(self, member_id: int) -> Membership:
        return get_object_or_404(selectors.members_of(tenant=self.tenant), pk=member_id)

    @extend_schema(responses=MemberOutput)
    def get(self, request, member_id: int):
        return Response(MemberOutput(self._membership(member_id)).data)

    @extend_schema(request=MemberUpdateInput, responses=MemberOutput)
    def patch(self, request, member_id: int):
        membership = self._membership(member_id)
        data = MemberUpdateInput(data=request.data, partial=True)  # as any PATCH: {} changes nothing
        data.is_valid(raise_exception=True)
        if data.validated_data:
            membership = services.member_change_role(actor=self.actor, membership=membership, **data.validated_data)
        return Response(MemberOutput(membership).data)

    @extend_schema(responses={204: None})
    def delete(self, request, member_id: int):
        membership = self._membership(member_id)
        services.member_remove(actor=self.actor, membership=membership)
        return Response(status=status.HTTP_204_NO_CONTENT)


class TenantListApi(StaffAPIView):
    pagination_class = StrictLimitOffsetPagination
    query_input = TenantListQueryInput
    @extend_schema(parameters=[TenantListQueryInput], responses=TenantOutput(many=True))
    def get(self, request):
        query = self.query_input(data=request.query_params)
        query.is_valid(raise_exception=True)
        tenants = Tenant.objects.select_related("plan").order_by("slug")
        if search := query.validated_data.get("search"):
            tenants = tenants.filter(slug__icontains=search) | tenants.filter(name__icontains=search)
        if status_ := query.validated_data.get("status"):
            tenants = tenants.filter(status=status_)
        return _page(self, request, tenants, TenantOutput)

    @extend_schema(request=TenantCreateInput, responses={201: TenantOutput})
    def post(self, request):
        data = TenantCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        tenant = services.tenant_create(actor=self.actor, **data.validated_data)
        return Response(TenantOutput(tenant).data, status=status.HTTP_201_CREATED)


class TenantDetailApi(StaffAPIView):
    @extend_schema(responses=TenantOutput)
    def get(self, request, slug: str):
        return Response(TenantOutput(get_object_or_404(Tenant.objects.select_related("plan"), slug=slug)).data)

    @extend_schema(request=TenantUpdateInput, responses=TenantOutput)
    def patch(self, request, slug: str):
        tenant = get_object_or_404(Tenant, slug=slug)
        data = TenantUpdateInput(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        tenant = services.tenant_update(actor=self.actor, tenant=tenant, changes=data.validated_data)
        return Response(TenantOutput(tenant).data)


class PlanListApi(StaffAPIView):
    pagination_class = StrictLimitOffsetPagination
    @extend_schema(responses=PlanOutput(many=True))
    def get(self, request):
        return _page(self, request, Plan.objects.all(), PlanOutput)

    @extend_schema(request=PlanInput, responses={201: PlanOutput})
    def post(self, request):
        data = PlanInput(data=request.data)
        data.is_valid(raise_exception=True)
        plan = services.plan_create(actor=self.actor, **data.validated_data)
        return Response(PlanOutput(plan).data, status=status.HTTP_201_CREATED)


class PlanDetailApi(StaffAPIView):
    @extend_schema(responses=PlanOutput)
    def get(self, request, slug: str):
        return Response(PlanOutput(get_object_or_404(Plan, slug=slug)).data)

    @extend_schema(request=PlanInput, responses=PlanOutput)
    def patch(self, request, slug: str):
        plan = get_object_or_404(Plan, slug=slug)
        data = PlanInput(plan, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        plan = services.plan_update(actor=self.actor, plan=plan, changes=data.validated_data)
        return Response(PlanOutput(plan).data)


class AuditLogApi(StaffAPIView):
    pagination_class = StrictLimitOffsetPagination
    query_input = StaffAuditLogQueryInput
    @extend_schema(parameters=[StaffAuditLogQueryInput], responses=AuditLogOutput(many=True))
    def get(self, request):
        query = self.query_input(data=request.query_params)
        query.is_valid(raise_exception=True)
        filters = dict(query.validated_data)
        if slug := filters.pop("tenant", ""):
            filters["tenant"] = get_object_or_404(Tenant, slug=slug)
        return _page(self, request, selectors.audit_log_list(**filters), AuditLogOutput)
