"""Content negotiation for the management API: an unknown `?format=` is a 400 naming the formats the API renders
(DRF answers 404, as if the URL did not exist), and so is any `?format=` on a URL whose suffix names the format
(`requests.csv?format=json`: the schema has no such parameter there). A `.csv` suffix that matches no route stays a
404."""

from rest_framework import exceptions
from rest_framework.negotiation import DefaultContentNegotiation


class StrictContentNegotiation(DefaultContentNegotiation):
    def select_renderer(self, request, renderers, format_suffix=None):
        name = self.settings.URL_FORMAT_OVERRIDE
        requested = request.query_params.get(name) if name else None
        formats = [renderer.format for renderer in renderers]
        if requested is not None and format_suffix is not None:  # DRF would let the suffix win, silently
            raise exceptions.ValidationError({name: f"The URL's .{format_suffix} names the format; leave {name} out."})
        if requested is not None and requested not in formats:
            raise exceptions.ValidationError({name: f"Must be one of {', '.join(formats)}."})
        return super().select_renderer(request, renderers, format_suffix)
