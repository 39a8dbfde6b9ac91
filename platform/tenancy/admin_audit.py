"""Changes made in Django's admin are audited like any other: one AuditLog row per object added, changed or
deleted, in the admin's own transaction where it has one. Every registered ModelAdmin gets this (at startup, from
tenancy's AppConfig), so no app can forget it."""

from django.contrib import admin
from django.db import transaction

from tenancy.audit import Actor, audit_record
from tenancy.models import Tenant


def _tenant_of(obj) -> Tenant | None:
    if isinstance(obj, Tenant):
        return obj if obj.pk is not None else None
    tenant_id = getattr(obj, "tenant_id", None)
    return Tenant.objects.filter(pk=tenant_id).first() if tenant_id else None


def _audit(request, obj, action: str, message=None) -> None:
    actor = Actor(user=request.user, ip_address=request.META.get("REMOTE_ADDR") or None)
    tenant = _tenant_of(obj)
    with transaction.atomic():
        audit_record(
            actor=actor, action=action, target=obj, tenant=tenant,
            after={"model": obj._meta.label, "object": str(obj)[:200], "change": message or ""},
        )  # fmt: skip


class AuditedAdminMixin:
    def log_addition(self, request, obj, message):
        entry = super().log_addition(request, obj, message)
        _audit(request, obj, "admin.add", message)
        return entry

    def log_change(self, request, obj, message):
        entry = super().log_change(request, obj, message)
        _audit(request, obj, "admin.change", message)
        return entry

    def log_deletions(self, request, queryset):
        entries = super().log_deletions(request, queryset)
        for obj in queryset:
            _audit(request, obj, "admin.delete")
        return entries


def audit_every_admin(site: admin.AdminSite = admin.site) -> None:
    for model_admin in site._registry.values():
        cls = type(model_admin)
        if not issubclass(cls, AuditedAdminMixin):
            model_admin.__class__ = type(f"Audited{cls.__name__}", (AuditedAdminMixin, cls), {})
