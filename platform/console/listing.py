"""Server-side paging and sorting for every console table.

A view names the columns a user may sort by (a public key -> the fields to order by) and hands over a
queryset; `listing(...)` reads `?sort=` and `?page=` from the request, applies a whitelisted ordering and
returns one page. Links keep the page's other filters.
"""

from dataclasses import dataclass, field

from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from django.http import QueryDict

PAGE_SIZE = 25


@dataclass
class Listing:
    page: Page
    sort: str
    sortable: tuple[str, ...]
    query: QueryDict = field(repr=False)

    @property
    def rows(self):
        return self.page.object_list

    def url_with(self, **changes) -> str:
        query = self.query.copy()
        for key, value in changes.items():
            if value in (None, ""):
                query.pop(key, None)
            else:
                query[key] = str(value)
        encoded = query.urlencode()
        return f"?{encoded}" if encoded else "?"

    def sort_url(self, column: str) -> str:
        descending = self.sort == column
        return self.url_with(sort=f"-{column}" if descending else column, page=None)

    def sort_state(self, column: str) -> str:
        if self.sort == column:
            return "ascending"
        if self.sort == f"-{column}":
            return "descending"
        return ""

    def page_url(self, number: int) -> str:
        return self.url_with(page=number)


def listing(
    request,
    rows: QuerySet,
    *,
    sortable: dict[str, tuple[str, ...]],
    default_sort: str,
    per_page: int = PAGE_SIZE,
) -> Listing:
    sort = request.GET.get("sort", default_sort)
    if sort.lstrip("-") not in sortable:
        sort = default_sort
    fields = sortable[sort.lstrip("-")]
    descending = sort.startswith("-")
    ordering = [f"-{name.lstrip('-')}" if descending != name.startswith("-") else name.lstrip("-") for name in fields]
    paginator = Paginator(rows.order_by(*ordering), per_page)
    page = paginator.get_page(request.GET.get("page"))
    return Listing(page=page, sort=sort, sortable=tuple(sortable), query=request.GET)


def listing_of_rows(
    request,
    rows: list,
    *,
    sortable: dict[str, str],
    default_sort: str,
    per_page: int = PAGE_SIZE,
) -> Listing:
    """The same for rows already summed in Python (a few hundred at most): sorts by an attribute name."""
    sort = request.GET.get("sort", default_sort)
    if sort.lstrip("-") not in sortable:
        sort = default_sort
    attribute = sortable[sort.lstrip("-")]
    ordered = sorted(rows, key=lambda row: getattr(row, attribute), reverse=sort.startswith("-"))
    page = Paginator(ordered, per_page).get_page(request.GET.get("page"))
    return Listing(page=page, sort=sort, sortable=tuple(sortable), query=request.GET)
