"""The request log: a tenant's requests (staff: every tenant's), filtered by key, adapter, model, status and time,
sorted, paged by cursor; each row opens the request's detail; the same rows as CSV.

Rows and paging come from metering.request_log; this module reads the query and arranges the page.
"""

import csv
from datetime import UTC, datetime, time, timedelta

from django import forms
from django.http import Http404, StreamingHttpResponse

from apikeys.selectors import api_keys_of
from console.access import CsvQueryError, Role, csv_download, staff_page, tenant_page
from console.pages import render_page
from metering.request_log import (
    SORTS,
    STATUSES,
    BadCursor,
    LogFilters,
    request_detail,
    request_log_filtered,
    request_log_page,
    request_status,
)
from registry.selectors import adapters_of
from tenancy.models import Tenant

PAGE_ROWS = 50
CSV_MAX_ROWS = 100_000
CSV_FIELDS = [
    "request_id", "finished_at", "tenant", "api_key_prefix", "model", "base_model", "adapter", "adapter_version",
    "status", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms", "e2e_ms",
    "queue_ms", "price", "error",
]  # fmt: skip
SORT_CHOICES = [(f"{sign}{name}", f"{sign}{name}") for name in SORTS for sign in ("-", "")]


class LogQueryForm(forms.Form):
    key = forms.CharField(required=False, max_length=16)
    adapter = forms.CharField(required=False, max_length=200)
    model = forms.CharField(required=False, max_length=200)
    status = forms.ChoiceField(required=False, choices=[("", "any")] + [(name, name) for name in STATUSES])
    since = forms.DateField(required=False)
    until = forms.DateField(required=False, help_text="Inclusive.")
    tenant = forms.SlugField(required=False)
    sort = forms.ChoiceField(required=False, choices=SORT_CHOICES)
    cursor = forms.CharField(required=False, max_length=400)

    def filters(self, *, staff: bool) -> LogFilters:
        data = self.cleaned_data

        def start(day):
            return datetime.combine(day, time.min, tzinfo=UTC) if day else None

        return LogFilters(
            key_prefix=data["key"], adapter=data["adapter"], model=data["model"], status=data["status"],
            since=start(data["since"]), until=start(data["until"] + timedelta(days=1)) if data["until"] else None,
            tenant_slug=data["tenant"] if staff else "",
        )  # fmt: skip


def _query(request, *, staff: bool) -> tuple[LogQueryForm, LogFilters]:
    form = LogQueryForm(request.GET)
    if not form.is_valid():
        problems = "; ".join(f"{name}: {' '.join(errors)}" for name, errors in form.errors.items())
        raise CsvQueryError(f"Bad filter ({problems}).")
    return form, form.filters(staff=staff)


def _page(request, *, tenant: Tenant | None):
    staff = tenant is None
    try:
        form, filters = _query(request, staff=staff)
        page = request_log_page(tenant=tenant, filters=filters, sort=form.cleaned_data["sort"] or "-time",
                                cursor=form.cleaned_data["cursor"], limit=PAGE_ROWS)  # fmt: skip
    except (CsvQueryError, BadCursor) as error:
        return render_page(request, "console/requests.html", {"problem": str(error), "form": LogQueryForm()},
                           section="platform-requests" if staff else "requests", status=400)  # fmt: skip
    query = request.GET.copy()
    query.pop("cursor", None)

    def sort_url(name: str) -> str:
        sorts = query.copy()
        sorts["sort"] = name if page.sort == f"-{name}" else f"-{name}"
        return "?" + sorts.urlencode()

    next_query = query.copy()
    if page.next_cursor:
        next_query["cursor"] = page.next_cursor
    context = {
        "form": form, "page": page, "staff": staff, "statuses": list(STATUSES),
        "sort_urls": {name: sort_url(name) for name in SORTS},
        "next_url": "?" + next_query.urlencode() if page.next_cursor else None,
        "first_url": "?" + query.urlencode() if form.cleaned_data["cursor"] else None,
        "csv_query": query.urlencode(),
        "adapters": list(adapters_of(tenant=tenant).values_list("name", flat=True)) if tenant is not None else [],
        "keys": list(api_keys_of(tenant=tenant).values_list("prefix", "name")) if tenant is not None else [],
    }  # fmt: skip
    return render_page(request, "console/requests.html", context, section="platform-requests" if staff else "requests")


def _csv(request, *, tenant: Tenant | None, filename: str):
    form, filters = _query(request, staff=tenant is None)
    rows = request_log_filtered(tenant=tenant, filters=filters).select_related("tenant", "adapter_version__adapter")
    rows = rows.order_by("-finished_at", "-id")[:CSV_MAX_ROWS]

    class Echo:
        def write(self, value):
            return value

    writer = csv.writer(Echo())

    def lines():
        yield writer.writerow(CSV_FIELDS)
        for event in rows.iterator(chunk_size=2000):
            version = event.adapter_version
            yield writer.writerow([
                event.request_id, event.finished_at.isoformat(), event.tenant.slug, event.api_key_prefix, event.model,
                event.base_model, version.adapter.name if version else "", version.number if version else "",
                request_status(event), event.finish_reason, event.prompt_tokens, event.cached_tokens,
                event.completion_tokens, _ms(event.ttft_ms), _ms(event.e2e_ms), _ms(event.queue_ms), event.price,
                event.error,
            ])  # fmt: skip

    response = StreamingHttpResponse(lines(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def _ms(value) -> str:
    return "" if value is None else f"{value:.1f}"


def _detail(request, *, tenant: Tenant | None, request_id: str):
    found = request_detail(tenant=tenant, request_id=request_id)
    if found is None:
        raise Http404("No such request.")
    event, body = found
    context = {"event": event, "body": body, "staff": tenant is None}
    section = "platform-requests" if tenant is None else "requests"
    return render_page(request, "console/request.html", context, section=section)


@tenant_page(Role.VIEWER)
def tenant_requests(request):
    return _page(request, tenant=request.seat.tenant)


@csv_download
@tenant_page(Role.VIEWER)
def tenant_requests_csv(request):
    return _csv(request, tenant=request.seat.tenant, filename=f"{request.seat.tenant.slug}-requests.csv")


@tenant_page(Role.VIEWER)
def tenant_request(request, request_id: str):
    return _detail(request, tenant=request.seat.tenant, request_id=request_id)


@staff_page
def platform_requests(request):
    return _page(request, tenant=None)


@csv_download
@staff_page
def platform_requests_csv(request):
    return _csv(request, tenant=None, filename="requests.csv")


@staff_page
def platform_request(request, request_id: str):
    return _detail(request, tenant=None, request_id=request_id)
