"""CSV for the usage and invoice APIs (`?format=csv` or a `.csv` path): DRF ships no CSV renderer, and one list
of flat rows needs only the standard library's csv module."""

import csv
import io

from rest_framework.renderers import BaseRenderer


class CsvRenderer(BaseRenderer):
    """Renders a list of flat dicts (the view hands over rows, not the JSON envelope). Errors never reach it: the API's
    exception handler answers them in JSON."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None) -> bytes:
        header = getattr((renderer_context or {}).get("view"), "csv_header", None)
        rows = data or []
        out = io.StringIO()
        writer = csv.DictWriter(
            out, fieldnames=header or (list(rows[0]) if rows else []), lineterminator="\n"
        )
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue().encode(self.charset)
