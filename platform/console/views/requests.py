"""The request log: a tenant's requests (staff: every tenant's), filtered by key, adapter, model, status and time,
sorted, paged by cursor; each row opens the request's detail; the same rows as CSV.

Rows and paging come from metering.request_log; this module reads the query and arranges the page.
"""

from django import forms
from django.http import Http404, StreamingHttpResponse

from apikeys.selectors import api_keys_of
from console.access import CsvQueryError, Role, actor_of, csv_download, staff_page, tenant_page
from console.forms import DayOrInstantField
from console.pages import render_page
from metering.pricing import plan_rates
from metering.request_log import (
    SORTS,
    STATUSES,
    BadCursor,
    LogFilters,
    bodies_readable,
    request_detail,
    request_log_page,
    request_log_totals,
)
from metering.request_log_csv import request_log_csv, since_instant, until_instant
from registry.selectors import adapters_of
from tenancy.models import Tenant

PAGE_ROWS = 50
SORT_CHOICES = [(f"{sign}{name}", f"{sign}{name}") for name in SORTS for sign in ("-", "")]


class LogQueryForm(forms.Form):
    key = forms.CharField(required=False, max_length=16)
    adapter = forms.CharField(required=False, max_length=200)
    model = forms.CharField(required=False, max_length=200)
    status = forms.ChoiceField(required=False, choices=[("", "any")] + [(name, name) for name in STATUSES])
    since = DayOrInstantField(help_text="From the start of this UTC day, or from this instant (included).")
    until = DayOrInstantField(help_text="Through the end of this UTC day (included), or up to this instant (excluded).")
    tenant = forms.SlugField(required=False)
    sort = forms.ChoiceField(required=False, choices=SORT_CHOICES)
    cursor = forms.CharField(required=False, max_length=400)
    start = forms.IntegerField(required=False, min_value=1)  # the page's first row's position, for "51–100 of N"

    def filters(self, *, staff: bool) -> LogFilters:
        data = self.cleaned_data
        return LogFilters(
            key_prefix=data["key"], adapter=data["adapter"], model=data["model"], status=data["status"],
            since=since_instant(data["since"]), until=until_instant(data["until"]),
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
    query.pop("start", None)
    start = form.cleaned_data["start"] if form.cleaned_data["cursor"] and form.cleaned_data["start"] else 1

    def sort_url(name: str) -> str:
        sorts = query.copy()
        sorts["sort"] = name if page.sort == f"-{name}" else f"-{name}"
        return "?" + sorts.urlencode()

    next_query = query.copy()
    if page.next_cursor:
        next_query["cursor"] = page.next_cursor
        next_query["start"] = start + len(page.rows)
    context = {
        "form": form, "page": page, "staff": staff, "statuses": list(STATUSES),
        "totals": request_log_totals(tenant=tenant, filters=filters),
        "first_row": start, "last_row": start + len(page.rows) - 1,
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
    lines = request_log_csv(tenant=tenant, filters=filters, sort=form.cleaned_data["sort"] or "-time")
    response = StreamingHttpResponse(lines, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def _detail(request, *, tenant: Tenant | None, request_id: str):
    reader = actor_of(request)
    found = request_detail(tenant=tenant, request_id=request_id, reader=reader)
    if found is None:
        raise Http404("No such request.")
    event, body = found
    context = {"event": event, "body": body, "staff": tenant is None,
               "bodies_readable": bodies_readable(reader=reader, tenant=event.tenant)}  # fmt: skip
    if event.status == "refused" and event.tenant is not None:  # not charged: the plan's rates (anonymous: no plan)
        plan_default, by_base_model = plan_rates(plan=event.tenant.plan)
        context["plan_rates"] = by_base_model.get(event.base_model, plan_default)
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
