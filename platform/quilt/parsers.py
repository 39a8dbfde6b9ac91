"""The management API's JSON parser: DRF's, plus a clear 400 for JSON nested deeper than the parser can walk
(json.loads raises RecursionError there, which DRF's parser lets through as a 500)."""

from rest_framework import exceptions
from rest_framework.parsers import JSONParser


class QuiltJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError("JSON parse error - the body is nested too deeply.") from None
