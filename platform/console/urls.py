from django.contrib.auth import views as auth_views
from django.templatetags.static import static
from django.urls import include, path, reverse_lazy
from django.views.generic import RedirectView

from console.views import (
    adapters,
    audit,
    billing,
    economics,
    engines,
    fine_tuning,
    home,
    invitation,
    invoicing,
    keys,
    live_relay,
    members,
    overview,
    plans,
    requests,
    settings,
    tenants,
    usage,
)
from console.views.post_only import post_only

app_name = "console"

tenant_urls = [
    path("", overview.tenant_overview, name="tenant-overview"),
    path("keys/", keys.keys, name="keys"),
    path("keys/<str:prefix>/revoke/", keys.key_revoke, name="key-revoke"),
    path("keys/<str:prefix>/rotate/", keys.key_rotate, name="key-rotate"),
    path("keys/<str:prefix>/limits/", keys.key_limits, name="key-limits"),
    path("members/", members.members, name="members"),
    path("members/<int:member_id>/role/", members.member_role, name="member-role"),
    path("members/<int:member_id>/remove/", members.member_remove_view, name="member-remove"),
    path("invitations/<int:invitation_id>/revoke/", members.invitation_revoke_view, name="invitation-revoke"),
    path("audit/", audit.tenant_audit, name="audit"),
    path("settings/", settings.tenant_settings, name="settings"),
    path("settings/webhook-secret/", settings.webhook_secret_rotate, name="webhook-secret"),
    path("adapters/", adapters.adapters, name="adapters"),
    path("adapters/upload/", adapters.adapter_upload, name="adapter-upload"),
    path("adapters/<str:name>/", adapters.adapter_detail, name="adapter"),
    path("adapters/<str:name>/promote/", adapters.adapter_promote_view, name="adapter-promote"),
    path("adapters/<str:name>/rollback/", adapters.adapter_rollback_view, name="adapter-rollback"),
    path("adapters/<str:name>/delete/", adapters.adapter_delete_view, name="adapter-delete"),
    path("fine-tuning/", fine_tuning.fine_tuning, name="fine-tuning"),
    path("usage/", usage.usage, name="usage"),
    path("usage.csv", usage.usage_csv, name="usage-csv"),
    path("requests/", requests.tenant_requests, name="requests"),
    path("requests.csv", requests.tenant_requests_csv, name="requests-csv"),
    path("requests/<str:request_id>/", requests.tenant_request, name="request"),
    path("billing/", billing.billing, name="billing"),
    path("billing/invoices/<int:invoice_id>/", billing.invoice, name="invoice"),
    path("billing/invoices/<int:invoice_id>.csv", billing.invoice_csv, name="invoice-csv"),
]

platform_urls = [
    path("", overview.platform_overview, name="platform"),
    path("tenants/", tenants.tenants, name="tenants"),
    path("tenants/new/", tenants.tenant_new, name="tenant-new"),
    path("tenants/<slug:slug>/", tenants.tenant_detail, name="tenant-detail"),
    path("tenants/<slug:slug>/plan/", tenants.tenant_plan, name="tenant-plan"),
    path("tenants/<slug:slug>/status/", tenants.tenant_status, name="tenant-status"),
    path("engines/", engines.engines, name="engines"),
    path("economics/", economics.economics, name="economics"),
    path("requests/", requests.platform_requests, name="platform-requests"),
    path("requests.csv", requests.platform_requests_csv, name="platform-requests-csv"),
    path("requests/<str:request_id>/", requests.platform_request, name="platform-request"),
    path("invoicing/", invoicing.invoicing, name="invoicing"),
    path("invoicing/issue/", invoicing.invoicing_issue, name="invoicing-issue"),
    path("plans/", plans.plans, name="plans"),
    path("plans/new/", plans.plan_new, name="plan-new"),
    path("plans/<slug:plan_slug>/", plans.plan_edit, name="plan-edit"),
    path("audit/", audit.platform_audit, name="platform-audit"),
]


urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="console/login.html", redirect_authenticated_user=True),
         name="login"),
    path("logout/", post_only(auth_views.LogoutView.as_view()), name="logout"),
    path(
        "welcome/<uidb64>/<token>/",
        auth_views.PasswordResetConfirmView.as_view(
            template_name="console/password_set.html", success_url=reverse_lazy("console:login"),
            post_reset_login=False,
        ),
        name="password-set",
    ),
    path("invitations/<str:token>/", invitation.invitation_accept_view, name="invitation"),
    path("internal/live-relay/", live_relay.live_relay, name="live-relay"),
    path("favicon.ico", RedirectView.as_view(url=static("console/favicon.svg"), permanent=True)),
    path("", home.home, name="overview"),
    path("switch/", home.switch, name="switch"),
    path("no-tenant/", overview.no_tenant, name="no-tenant"),
    path("t/<slug:slug>/", include(tenant_urls)),
    path("platform/", include(platform_urls)),
]
