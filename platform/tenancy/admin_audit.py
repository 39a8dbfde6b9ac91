"""Changes made in Django's admin are audited as the API audits them: one AuditLog row per object added, changed or
deleted, named `<model>.create`, `<model>.update` or `<model>.delete` (`plan.update`, as `tenancy.services.
plan_update` names it), with the object's fields before and after, the staff user as the actor, in the admin's own
transaction. Inline rows (a tenant's memberships) get rows of their own. Every registered ModelAdmin gets this (at
startup, from tenancy's AppConfig), so no app can forget it."""

import json
import re

from django.apps import apps
from django.contrib import admin
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction
from django.db.models.fields.files import FieldFile
from django.forms.models import model_to_dict

from tenancy.audit import Actor, audit_record
from tenancy.models import Tenant

SECRET = re.compile(r"password|secret|hash|token", re.IGNORECASE)  # never copied into the audit log


def action_name(model: type[models.Model], verb: str) -> str:
    """`Plan` -> "plan.update", `BaseModel` -> "base_model.update": the API's services' names."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", model.__name__).lower() + "." + verb


def _plain(value):
    if isinstance(value, models.Model):
        return value.pk
    if isinstance(value, list | tuple | set):
        return [_plain(item) for item in value]
    if isinstance(value, FieldFile):
        return value.name
    return json.loads(json.dumps(value, cls=DjangoJSONEncoder))


def snapshot(obj: models.Model, fields=None) -> dict:
    """The object's editable fields (those named, if given) as JSON, secrets left out."""
    data = model_to_dict(obj, fields=fields)
    return {name: _plain(value) for name, value in data.items() if not SECRET.search(name)}


def _tenant_of(obj) -> Tenant | None:
    if isinstance(obj, Tenant):
        return obj if obj.pk is not None else None
    tenant_id = getattr(obj, "tenant_id", None)
    return Tenant.objects.filter(pk=tenant_id).first() if tenant_id else None


def _record(request, obj, verb: str, *, before: dict | None = None, after: dict | None = None) -> None:
    if verb == "update" and before == after:
        return  # saved unchanged: nothing happened
    actor = Actor(user=request.user, ip_address=request.META.get("REMOTE_ADDR") or None)
    with transaction.atomic():
        audit_record(actor=actor, action=action_name(type(obj), verb), target=obj, tenant=_tenant_of(obj),
                     before=before, after=after)  # fmt: skip


def _stored(obj) -> models.Model | None:
    return type(obj)._default_manager.filter(pk=obj.pk).first() if obj.pk is not None else None


class AuditedAdminMixin:
    def save_model(self, request, obj, form, change):
        fields = list(form.fields)
        stored = _stored(obj) if change else None
        before = snapshot(stored, fields) if stored is not None else None
        super().save_model(request, obj, form, change)
        _record(request, obj, "update" if before is not None else "create", before=before,
                after=snapshot(obj, fields))  # fmt: skip

    def save_formset(self, request, form, formset, change):
        fields = [name for name in formset.form.base_fields if name not in ("id", "DELETE")]
        before = {}
        for inline_form in formset.forms:
            stored = _stored(inline_form.instance)
            if stored is not None:
                before[stored.pk] = snapshot(stored, fields)
        for inline_form in formset.deleted_forms:  # recorded while they still have their ids
            if inline_form.instance.pk in before:
                _record(request, inline_form.instance, "delete", before=before[inline_form.instance.pk])
        super().save_formset(request, form, formset, change)
        for obj in formset.new_objects:
            _record(request, obj, "create", after=snapshot(obj, fields))
        for obj, _ in formset.changed_objects:
            _record(request, obj, "update", before=before.get(obj.pk), after=snapshot(obj, fields))

    def delete_model(self, request, obj):
        before = snapshot(obj)
        with transaction.atomic():
            _record(request, obj, "delete", before=before)
            super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        with transaction.atomic():
            for obj in queryset:
                _record(request, obj, "delete", before=snapshot(obj))
            super().delete_queryset(request, queryset)


def audit_every_admin(site: admin.AdminSite = admin.site) -> None:
    for model in apps.get_models(include_auto_created=True):
        if not site.is_registered(model):
            continue
        model_admin = site.get_model_admin(model)
        cls = type(model_admin)
        if not issubclass(cls, AuditedAdminMixin):
            model_admin.__class__ = type(f"Audited{cls.__name__}", (AuditedAdminMixin, cls), {})
