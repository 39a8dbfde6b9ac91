"""A form refused by Django's CSRF check: the console's page, saying why and leading back to the form's page.

Users meet it when a page stayed open while they logged out and in again in another tab (logging in gives a new
token). Django's own page is bare and tells them nothing they can act on."""

from django.http import JsonResponse
from django.shortcuts import render

from console.access import page_to_return_to
from quilt.api_errors import error_body, is_api

FORM_EXPIRED = "This form expired (you logged in or out in another tab): reload the page and send it again."


def csrf_failure(request, reason: str = ""):
    if is_api(request):
        message = "CSRF verification failed: send the session's CSRF token in X-CSRFToken."
        return JsonResponse(error_body(message=message, status_code=403, code="csrf_failed"), status=403)
    if request.headers.get("x-requested-with") == "XMLHttpRequest":  # the upload form shows `errors`
        return JsonResponse({"errors": [FORM_EXPIRED]}, status=403)
    return render(request, "403_csrf.html", {"back": page_to_return_to(request) or "/"}, status=403)
