"""A tenant's own settings (admins): where billing mail and budget webhooks go, and the webhook signing secret,
which is shown once when set or rotated and never again."""

from django import forms
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import redirect
from django.utils.html import format_html

from console.access import Role, actor_of, tenant_page
from console.pages import render_page
from console.views.post_only import post_only
from tenancy.services import tenant_settings_update, tenant_webhook_secret_set


class TenantSettingsForm(forms.Form):
    billing_email = forms.EmailField(required=False)
    webhook_url = forms.URLField(required=False, max_length=200, assume_scheme="https")
    request_body_retention_days = forms.IntegerField(required=False, min_value=0, max_value=90, initial=0)


def _page(request, *, form=None, status=200):
    tenant = request.seat.tenant
    form = form or TenantSettingsForm(initial={
        "billing_email": tenant.billing_email, "webhook_url": tenant.webhook_url,
        "request_body_retention_days": tenant.request_body_retention_days,
    })  # fmt: skip
    context = {"form": form, "has_secret": bool(tenant.webhook_secret)}
    return render_page(request, "console/settings.html", context, section="settings", status=status)


@tenant_page(Role.ADMIN, billing=True)
def tenant_settings(request):
    if request.method != "POST":
        return _page(request)
    form = TenantSettingsForm(request.POST)
    if not form.is_valid():
        return _page(request, form=form, status=400)
    try:
        changes = {name: value for name, value in form.cleaned_data.items() if value is not None}  # None: not sent
        tenant_settings_update(actor=actor_of(request), tenant=request.seat.tenant, changes=changes)
    except ValidationError as error:
        form.add_error(None, error)  # full_clean's errors name the form's own fields
        return _page(request, form=form, status=400)
    messages.success(request, "Settings saved.")
    return redirect("console:settings", slug=request.seat.tenant.slug)


@post_only
@tenant_page(Role.ADMIN)
def webhook_secret_rotate(request):
    secret = tenant_webhook_secret_set(actor=actor_of(request), tenant=request.seat.tenant, secret="")
    messages.success(request, format_html(
        "New webhook secret, shown only this once: copy it to your receiver now. "
        '<code class="secret" data-testid="webhook-secret">{}</code>', secret,
    ))  # fmt: skip
    return redirect("console:settings", slug=request.seat.tenant.slug)
