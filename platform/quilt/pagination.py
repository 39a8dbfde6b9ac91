"""Lists page with ?limit=&offset= (at most 200 a page); a limit or offset that is not a whole number, or a limit
past the largest page, is a 400, not silently the default or the largest page. So is a parameter the list does
not take (`?page=2`, `?sort=`): a view's filters are the fields of its `query_input` serializer."""

from rest_framework import exceptions
from rest_framework.pagination import LimitOffsetPagination


class StrictLimitOffsetPagination(LimitOffsetPagination):
    max_limit = 200

    def _whole(self, request, name: str, minimum: int, maximum: int | None = None) -> None:
        raw = request.query_params.get(name)
        if raw is None:
            return
        if not raw.isascii() or not raw.isdigit() or int(raw) < minimum:
            raise exceptions.ValidationError({name: f"Must be a whole number, at least {minimum}."})
        if maximum is not None and int(raw) > maximum:
            raise exceptions.ValidationError({name: f"Must be at most {maximum}."})

    def _known(self, request, view) -> None:
        query_input = getattr(view, "query_input", None)
        filters = query_input().fields if query_input is not None else ()
        known = {self.limit_query_param, self.offset_query_param, "format", *filters}
        unknown = sorted(name for name in request.query_params if name not in known)
        if unknown:
            takes = ", ".join(sorted(known - {"format"}))
            raise exceptions.ValidationError({name: f"Unknown parameter; this list takes {takes}." for name in unknown})

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: {"minimum": 1, "maximum": self.max_limit},
                  self.offset_query_param: {"minimum": 0}}  # fmt: skip
        for parameter in parameters:
            parameter["schema"] |= bounds.get(parameter["name"], {})
        return parameters

    def paginate_queryset(self, queryset, request, view=None):
        self._known(request, view)
        self._whole(request, self.limit_query_param, 1, self.max_limit)
        self._whole(request, self.offset_query_param, 0)
        return super().paginate_queryset(queryset, request, view)
