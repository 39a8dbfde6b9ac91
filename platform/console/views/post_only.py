"""POST-only console actions (revoke, rotate, remove…) opened with GET: the console's page, not a blank 405.

Users meet it when they open an action's URL from history or paste it: the action runs only from its button. The
page leads back to the nearest page above the action's URL (the keys list for a key's revoke URL)."""

from functools import wraps

from django.shortcuts import render
from django.urls import Resolver404, resolve


def post_only(view):
    """Like require_POST, with the console's 405 page for any other method."""

    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if request.method != "POST":
            response = render(request, "405.html", {"back": _page_above(request.path)}, status=405)
            response["Allow"] = "POST"
            return response
        return view(request, *args, **kwargs)

    wrapped.post_only = True
    return wrapped


def _page_above(path: str) -> str:
    parts = path.strip("/").split("/")
    for end in range(len(parts) - 1, 0, -1):
        above = "/" + "/".join(parts[:end]) + "/"
        try:
            match = resolve(above)
        except Resolver404:
            continue
        if not getattr(match.func, "post_only", False):
            return above
    return "/"
