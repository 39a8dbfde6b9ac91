"""DRF authentication by `Authorization: Bearer <key>`. The tenant comes from the key, never from the body."""

from django.contrib.auth.models import AnonymousUser
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from apikeys.selectors import KeyRefused, api_key_authenticate


class KeyAuthenticationFailed(exceptions.AuthenticationFailed):
    def __init__(self, refused: KeyRefused):
        super().__init__(detail=refused.reason, code=refused.code)
        if refused.code == "tenant_suspended":
            self.status_code = 403


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        keyword, _, presented = header.partition(" ")
        if keyword != self.keyword or not presented.strip():
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <API key>'.", code="invalid_api_key")
        try:
            key = api_key_authenticate(presented=presented.strip())
        except KeyRefused as refused:
            raise KeyAuthenticationFailed(refused) from None
        return AnonymousUser(), key

    def authenticate_header(self, request):
        return self.keyword


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = ApiKeyAuthentication
    name = "ApiKeyAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "A tenant API key: `Bearer <prefix>.<secret>`."}
