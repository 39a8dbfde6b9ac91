"""Template helpers for the console: icons, number and money formats, status badges, sortable headers, pager."""

import json
import math
from decimal import ROUND_HALF_UP, Decimal

from django import template
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import mark_safe
from django.utils.timesince import timesince

from console.money_format import money_exact_text, money_text

register = template.Library()

# Line icons on a 24-unit grid, stroke-drawn (drawn for Quilt; no icon font).
ICONS = {
    "home": '<path d="M3 11l9-7 9 7"/><path d="M5 10v10h14V10"/><path d="M10 20v-6h4v6"/>',
    "layers": '<path d="M12 3l9 5-9 5-9-5z"/><path d="M3 13l9 5 9-5"/>',
    "chart": '<path d="M4 20V4"/><path d="M4 20h16"/><path d="M8 16v-5"/><path d="M12 16V8"/><path d="M16 16v-3"/>',
    "key": '<circle cx="8" cy="15" r="4"/><path d="M11 12l9-9"/><path d="M16 7l3 3"/><path d="M14 9l2 2"/>',
    "users": '<circle cx="9" cy="8" r="3.5"/><path d="M2.5 20c.8-3.6 3.3-5.5 6.5-5.5s5.7 1.9 6.5 5.5"/>'
    '<path d="M16 4.6a3.5 3.5 0 010 6.8"/><path d="M18 14.8c1.9.8 3 2.6 3.5 5.2"/>',
    "card": '<rect x="3" y="5" width="18" height="14" rx="2"/><path d="M3 10h18"/><path d="M7 15h4"/>',
    "list": '<path d="M9 6h11"/><path d="M9 12h11"/><path d="M9 18h11"/><circle cx="4.5" cy="6" r="1"/>'
    '<circle cx="4.5" cy="12" r="1"/><circle cx="4.5" cy="18" r="1"/>',
    "grid": '<rect x="3" y="3" width="7" height="7" rx="1"/><rect x="14" y="3" width="7" height="7" rx="1"/>'
    '<rect x="3" y="14" width="7" height="7" rx="1"/><rect x="14" y="14" width="7" height="7" rx="1"/>',
    "building": '<path d="M4 21V5l8-2v18"/><path d="M12 9l8 2v10"/><path d="M2 21h20"/><path d="M7 8h2"/>'
    '<path d="M7 12h2"/><path d="M7 16h2"/><path d="M15 14h2"/><path d="M15 17h2"/>',
    "cpu": '<rect x="6" y="6" width="12" height="12" rx="2"/><rect x="9.5" y="9.5" width="5" height="5"/>'
    '<path d="M9 2v4M15 2v4M9 18v4M15 18v4M2 9h4M2 15h4M18 9h4M18 15h4"/>',
    "tag": '<path d="M3 12V4a1 1 0 011-1h8l9 9-9 9z"/><circle cx="8" cy="8" r="1.5"/>',
    "plus": '<path d="M12 5v14M5 12h14"/>',
    "upload": '<path d="M12 16V4"/><path d="M7 9l5-5 5 5"/><path d="M4 16v4h16v-4"/>',
    "download": '<path d="M12 4v12"/><path d="M7 11l5 5 5-5"/><path d="M4 16v4h16v-4"/>',
    "copy": '<rect x="8" y="8" width="12" height="12" rx="2"/><path d="M16 8V5a1 1 0 00-1-1H5a1 1 0 00-1 1v10a1 1 0 001 1h3"/>',
    "alert": '<path d="M12 3l10 18H2z"/><path d="M12 10v5"/><path d="M12 18v.01"/>',
    "check": '<path d="M5 12l5 5 9-10"/>',
    "search": '<circle cx="11" cy="11" r="7"/><path d="M20 20l-4-4"/>',
    "logout": '<path d="M15 4h4a1 1 0 011 1v14a1 1 0 01-1 1h-4"/><path d="M10 17l5-5-5-5"/><path d="M15 12H3"/>',
    "chevron": '<path d="M8 10l4 4 4-4"/>',
    "refresh": '<path d="M20 11a8 8 0 00-14.9-3"/><path d="M4 4v4h4"/><path d="M4 13a8 8 0 0014.9 3"/><path d="M20 20v-4h-4"/>',
}

STATUS_TONES = {
    "active": "green", "ready": "green", "healthy": "green", "paid": "green", "issued": "blue",
    "uploaded": "gray", "validating": "blue", "draft": "gray", "pending": "gray",
    "suspended": "amber", "expiring": "amber", "rotated": "amber", "stale": "amber",
    "failed": "red", "closed": "gray", "revoked": "red", "expired": "gray", "down": "red", "disabled": "gray",
    "owner": "violet", "admin": "blue", "developer": "green", "viewer": "gray", "current": "violet",
    "ok": "green", "error": "red", "aborted": "amber", "refused": "amber", "pinned": "violet",
}  # fmt: skip


@register.simple_tag
def icon(name: str, size: int = 18):
    return format_html(
        '<svg class="icon" width="{}" height="{}" viewBox="0 0 24 24" fill="none" stroke="currentColor" '
        'stroke-width="1.8" stroke-linecap="round" stroke-linejoin="round" aria-hidden="true">{}</svg>',
        size, size, mark_safe(ICONS[name]),
    )  # fmt: skip


@register.filter
def badge(status) -> str:
    status = str(status)
    tone = STATUS_TONES.get(status, "gray")
    return format_html('<span class="badge badge-{}" data-status="{}">{}</span>', tone, status, status)


COMPACT_UNITS = ((1e3, "K"), (1e6, "M"), (1e9, "B"), (1e12, "T"))


@register.filter
def compact(value) -> str:
    """12_345_678 -> 12.3M: token counts in cards and charts. One decimal below 100 of a unit, none from 100; what
    rounds up to 1000 of a unit is shown in the next (99_950 -> 100K, 999_950 -> 1.0M, never 100.0K or 1000K)."""
    if value in (None, ""):
        return "—"
    number = float(value)
    if abs(round(number)) < 1000:
        return f"{round(number):,}"
    for limit, suffix in COMPACT_UNITS:
        text = f"{number / limit:.1f}"
        if abs(float(text)) >= 100:
            text = f"{number / limit:.0f}"
        if abs(float(text)) < 1000 or suffix == COMPACT_UNITS[-1][1]:
            return text + suffix


@register.filter
def rate(value) -> str:
    """A measured rate to three significant digits, thousands separated: 29.518441 -> 29.5, 0.00055556 ->
    0.000556, 1234.5 -> 1,235."""
    if value in (None, ""):
        return "—"
    number = float(value)
    if number == 0 or abs(number) >= 100:
        return f"{number:,.0f}"
    places = 2 - math.floor(math.log10(abs(number)))
    return f"{number:,.{places}f}"


@register.filter
def thousands(value) -> str:
    return "—" if value in (None, "") else f"{int(value):,}"


@register.filter
def money(value) -> str:
    """Cents when there are cents, two significant digits below a cent: see console.money_format."""
    if value is None or value == "":
        return "—"
    return money_text(value)


@register.filter
def pretty_json(value) -> str:
    """A stored prompt (messages or text) as indented JSON for a <pre>."""
    return json.dumps(value, indent=2, ensure_ascii=False)


@register.filter
def money_exact(value) -> str:
    """Every decimal the amount has, at least two: invoice lines and subtotals (see console.money_format)."""
    if value is None or value == "":
        return "—"
    return money_exact_text(value)


@register.filter
def price(value) -> str:
    """Per-million-token prices as the plan stores them (up to six decimals, at least two): $0.0375, $0.000125.
    Rounding them would show a price other than the one usage and invoices are charged at."""
    if value is None or value == "":
        return "—"
    amount = Decimal(value).quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP).normalize()
    text = f"{amount:f}"
    if "." not in text:
        text += ".00"
    elif len(text.split(".")[1]) == 1:
        text += "0"
    return f"${text}"


@register.filter
def filesize(value) -> str:
    if value in (None, ""):
        return "—"
    size = float(value)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


@register.filter
def percent(value, total) -> int:
    if not total:
        return 0
    return int(min(Decimal(value or 0) * 100 / Decimal(total), Decimal(999)))


@register.simple_tag
def sort_th(listing, column: str, label: str, align: str = ""):
    state = listing.sort_state(column)
    arrow = {"ascending": "▲", "descending": "▼"}.get(state, "")
    return format_html(
        '<th class="{}" aria-sort="{}"><a class="sort {}" href="{}">{}<span class="arrow">{}</span></a></th>',
        align, state or "none", state, listing.sort_url(column), label, arrow,
    )  # fmt: skip


@register.inclusion_tag("console/_pager.html")
def pager(listing):
    return {"listing": listing, "page": listing.page}


@register.filter
def page_url(listing, number) -> str:
    return listing.page_url(number)


@register.filter
def get(mapping, key):
    return mapping.get(key, "") if mapping else ""


@register.filter
def ratio(value) -> str:
    """0.2345 -> 23.5%"""
    if value is None or value == "":
        return "—"
    return f"{Decimal(value) * 100:.1f}%"


@register.filter
def ago(moment) -> str:
    """'just now' under a minute, else Django's timesince ('3 hours ago')."""
    if moment is None:
        return "never"
    if (timezone.now() - moment).total_seconds() < 60:
        return "just now"
    return f"{timesince(moment).split(',')[0]} ago"
