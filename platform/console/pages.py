"""Rendering a console page: the page's own context plus the frame (navigation, tenant switcher, seat)."""

from dataclasses import dataclass

from django.shortcuts import render
from django.urls import reverse

from console.access import Seat
from tenancy.selectors import tenants_for_user

SWITCHER_LIMIT = 12


@dataclass(frozen=True)
class NavItem:
    label: str
    url: str
    icon: str
    section: str


def _tenant_nav(seat: Seat) -> list[NavItem]:
    slug = seat.tenant.slug

    def url(name: str) -> str:
        return reverse(f"console:{name}", kwargs={"slug": slug})

    items = [
        NavItem("Overview", url("tenant-overview"), "home", "overview"),
        NavItem("Adapters", url("adapters"), "layers", "adapters"),
        NavItem("Fine-tuning", url("fine-tuning"), "refresh", "fine-tuning"),
        NavItem("Usage", url("usage"), "chart", "usage"),
        NavItem("Requests", url("requests"), "list", "requests"),
        NavItem("API keys", url("keys"), "key", "keys"),
        NavItem("Members", url("members"), "users", "members"),
    ]
    if seat.can_see_billing:
        items.append(NavItem("Billing", url("billing"), "card", "billing"))
    if seat.can_see_audit:
        items.append(NavItem("Audit log", url("audit"), "list", "audit"))
    if seat.can_manage_members:
        items.append(NavItem("Settings", url("settings"), "grid", "settings"))
    return items


def _platform_nav() -> list[NavItem]:
    return [
        NavItem("Platform", reverse("console:platform"), "grid", "platform"),
        NavItem("Tenants", reverse("console:tenants"), "building", "tenants"),
        NavItem("Engines", reverse("console:engines"), "cpu", "engines"),
        NavItem("Economics", reverse("console:economics"), "card", "economics"),
        NavItem("Requests", reverse("console:platform-requests"), "list", "platform-requests"),
        NavItem("Plans", reverse("console:plans"), "tag", "plans"),
        NavItem("Invoicing", reverse("console:invoicing"), "card", "invoicing"),
        NavItem("Audit log", reverse("console:platform-audit"), "list", "platform-audit"),
    ]


def render_page(request, template: str, context: dict | None = None, *, section: str = "", status: int = 200):
    seat: Seat | None = getattr(request, "seat", None)
    switcher = list(tenants_for_user(user=request.user).order_by("name")[: SWITCHER_LIMIT + 1])
    frame = {
        "seat": seat,
        "section": section,
        "tenant_nav": _tenant_nav(seat) if seat else [],
        "platform_nav": _platform_nav() if request.user.is_staff else [],
        "switcher": switcher[:SWITCHER_LIMIT],
        "switcher_more": len(switcher) > SWITCHER_LIMIT,
    }
    return render(request, template, {**frame, **(context or {})}, status=status)
