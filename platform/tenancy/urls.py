from django.urls import path

from tenancy import api

urlpatterns = [
    path("tenant", api.OwnTenantApi.as_view(), name="api-own-tenant"),
    path("tenant/webhook-secret", api.WebhookSecretApi.as_view(), name="api-webhook-secret"),
    path("tenant/audit", api.OwnAuditLogApi.as_view(), name="api-own-audit"),
    path("members", api.MemberListApi.as_view(), name="api-members"),
    path("members/<int:member_id>", api.MemberDetailApi.as_view(), name="api-member"),
    path("invitations", api.InvitationListApi.as_view(), name="api-invitations"),
    path("invitations/<int:invitation_id>/revoke", api.InvitationRevokeApi.as_view(), name="api-invitation-revoke"),
    path("invitations/<str:token>", api.InvitationAcceptApi.as_view(), name="api-invitation"),
    path("tenants", api.TenantListApi.as_view(), name="api-tenants"),
    path("tenants/<slug:slug>", api.TenantDetailApi.as_view(), name="api-tenant"),
    path("plans", api.PlanListApi.as_view(), name="api-plans"),
    path("plans/<slug:slug>", api.PlanDetailApi.as_view(), name="api-plan"),
    path("audit", api.AuditLogApi.as_view(), name="api-audit"),
]
