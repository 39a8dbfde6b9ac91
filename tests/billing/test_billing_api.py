"""Invoice and margin APIs: a tenant sees only its own invoices (404 across tenants); margin is staff-only."""

import csv
import io
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest

from billing.invoices import invoice_issue
from billing.selectors import tenant_margin
from metering.services import usage_ingest
from tests.metering.usage import gpu_engine, priced_tenant, usage_event
from tests.platform.conftest import client_for_key, client_for_member
from tests.platform.factories import MembershipFactory, UserFactory, make_key

pytestmark = pytest.mark.django_db

OCTOBER = date(2026, 10, 1)


@pytest.fixture
def invoices():
    gpu_engine(price="3.6")
    acme, globex = priced_tenant("acme"), priced_tenant("globex")
    at = datetime(2026, 10, 7, tzinfo=UTC)
    usage_ingest(
        events=[
            usage_event(acme, model="support-bot", finished_at=at, completion_tokens=1_000_000, gpu_ms=1000),
            usage_event(acme, model="tiny-llama", finished_at=at, completion_tokens=2_000_000, gpu_ms=2000),
            usage_event(globex, finished_at=at, completion_tokens=4_000_000, gpu_ms=4_000_000),
        ]
    )
    return {
        "acme": invoice_issue(tenant=acme, month=OCTOBER),
        "globex": invoice_issue(tenant=globex, month=OCTOBER),
    }


def _key_client(tenant, scopes=("admin",)):
    return client_for_key(make_key(tenant, scopes=scopes)[1])


def test_list_and_detail(invoices):
    acme = invoices["acme"]
    client = _key_client(acme.tenant)
    listed = client.get("/api/v1/invoices").json()
    assert [(row["number"], row["month"], row["total"]) for row in listed["results"]] == [
        (acme.number, "2026-10", "4.50")
    ]
    detail = client.get(f"/api/v1/invoices/{acme.pk}").json()
    assert detail["status"] == "issued"
    assert [(line["model"], line["output_tokens"], line["amount"]) for line in detail["lines"]] == [
        ("support-bot", 1_000_000, "1.500425"),  # exact: the invoice rounds its total once
        ("tiny-llama", 2_000_000, "3.000425"),
    ]
    assert (detail["subtotal"], detail["minimum_charge"], detail["total"]) == ("4.50085", "0.00", "4.50")


@pytest.mark.parametrize("path", ["/api/v1/invoices/{id}.csv", "/api/v1/invoices/{id}?format=csv"])
def test_csv_export(invoices, path):
    acme = invoices["acme"]
    response = _key_client(acme.tenant).get(path.format(id=acme.pk))
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert f'filename="{acme.number}.csv"' in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(row["model"], row["amount"]) for row in rows] == [
        ("support-bot", "1.500425"),
        ("tiny-llama", "3.000425"),
        ("subtotal", "4.50085"),
        ("rounding", "-0.00085"),
        ("minimum_charge", "0.00"),
        ("total", "4.50"),
    ]
    assert rows[0]["price_output_per_mtok"] == "1.500000" and rows[0]["invoice"] == acme.number


@pytest.mark.parametrize("credential", ["key", "owner"])
def test_another_tenants_invoice_is_404(invoices, credential):
    acme, globex = invoices["acme"], invoices["globex"]
    if credential == "key":
        client = _key_client(acme.tenant)
    else:
        client = client_for_member(MembershipFactory(tenant=acme.tenant, role="owner"))
    for path in (
        f"/api/v1/invoices/{globex.pk}",
        f"/api/v1/invoices/{globex.pk}.csv",
        "/api/v1/invoices/999999",
    ):
        response = client.get(path)
        assert response.status_code == 404, path
    assert [row["number"] for row in client.get("/api/v1/invoices").json()["results"]] == [acme.number]


def test_invoices_need_the_admin_scope(invoices):
    for scopes in (("inference",), ("usage:read",)):
        response = _key_client(invoices["acme"].tenant, scopes=scopes).get("/api/v1/invoices")
        assert response.status_code == 403


@pytest.mark.parametrize(("role", "status"), [("viewer", 403), ("developer", 403), ("admin", 200), ("owner", 200)])
def test_one_role_rule_reads_invoices_in_the_api_and_the_console(invoices, role, status):
    acme = invoices["acme"]
    member = client_for_member(MembershipFactory(tenant=acme.tenant, role=role))
    slug = acme.tenant.slug
    for path in ("/api/v1/invoices", f"/api/v1/invoices/{acme.pk}", f"/api/v1/invoices/{acme.pk}.csv",
                 f"/t/{slug}/billing/", f"/t/{slug}/billing/invoices/{acme.pk}/",
                 f"/t/{slug}/billing/invoices/{acme.pk}.csv"):  # fmt: skip
        assert member.get(path).status_code == status, path
    overview = member.get(f"/t/{slug}/").content.decode()
    assert (f'href="/t/{slug}/billing/"' in overview) == (status == 200)


def test_margin_report_for_staff(invoices):
    staff = UserFactory(is_staff=True)
    client = client_for_member(MembershipFactory(tenant=invoices["acme"].tenant, user=staff, role="viewer"))
    report = client.get("/api/v1/reports/margin?month=2026-10").json()
    rows = {row["tenant"]: row for row in report["tenants"]}
    # acme: 2 × 0.000425 input + 3M output × 1.5 = 4.50085; GPU 3000 ms at 3.6 per hour = 0.003
    assert rows["acme"]["revenue"] == "4.500850" and rows["acme"]["gpu_cost"] == "0.003000"
    assert rows["acme"]["margin"] == "4.497850" and rows["acme"]["margin_ratio"] == "0.9993"
    assert rows["acme"]["uncosted_requests"] == 0
    # globex: 4M output = 6.000425 revenue; 4,000,000 ms = 1.111 hours at 3.6 = 4.0 cost
    assert (rows["globex"]["revenue"], rows["globex"]["gpu_cost"]) == ("6.000425", "4.000000")
    assert Decimal(report["margin"]) == Decimal("4.497850") + Decimal("2.000425")
    assert [row.tenant.slug for row in tenant_margin(month=OCTOBER)] == ["acme", "globex"]


def test_margin_report_is_staff_only(invoices):
    owner = client_for_member(MembershipFactory(tenant=invoices["acme"].tenant, role="owner"))
    assert owner.get("/api/v1/reports/margin?month=2026-10").status_code == 403
    assert (
        _key_client(invoices["acme"].tenant, scopes=("admin",))
        .get("/api/v1/reports/margin?month=2026-10")
        .status_code
        == 403
    )


def test_margin_month_must_be_yyyy_mm(invoices):
    staff = client_for_member(MembershipFactory(user=UserFactory(is_staff=True)))
    assert staff.get("/api/v1/reports/margin?month=2026-13").status_code == 400
    assert staff.get("/api/v1/reports/margin").status_code == 400
