"""Production: every secret and address from the environment; refuses to start without them."""

from django.core.exceptions import ImproperlyConfigured

from quilt.settings.base import *  # noqa: F403
from quilt.settings.base import database, env

SECRET_KEY = env("SECRET_KEY")
DATABASES = {"default": database(env("DATABASE_URL"))}
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS")
DEBUG = False

# The engines' shared secret: with a known one, anyone could report usage billed to any tenant.
QUILT_ENGINE_TOKEN = env("QUILT_ENGINE_TOKEN")
if len(QUILT_ENGINE_TOKEN) < 32 or QUILT_ENGINE_TOKEN == "dev-engine-token":
    raise ImproperlyConfigured("QUILT_ENGINE_TOKEN must be a secret of at least 32 characters.")
# Invitations and budget alerts are e-mail: a backend that only prints or keeps them in memory loses them.
EMAIL_BACKEND = env("EMAIL_BACKEND")
if EMAIL_BACKEND.rsplit(".", 1)[0] in {
    "django.core.mail.backends.console", "django.core.mail.backends.locmem", "django.core.mail.backends.dummy",
    "django.core.mail.backends.filebased",
}:  # fmt: skip
    raise ImproperlyConfigured(f"EMAIL_BACKEND must deliver mail in production, not {EMAIL_BACKEND}.")
EMAIL_HOST = env("EMAIL_HOST", default="localhost")
EMAIL_PORT = env.int("EMAIL_PORT", default=25)
EMAIL_HOST_USER = env("EMAIL_HOST_USER", default="")
EMAIL_HOST_PASSWORD = env("EMAIL_HOST_PASSWORD", default="")
EMAIL_USE_TLS = env.bool("EMAIL_USE_TLS", default=False)

# One HTTPS policy for the console, /api and the inference API (/v1 applies it in gateway.asgi).
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=True)
# Engines heartbeat from inside the cluster over plain HTTP, as gateways call them (the engine token authenticates);
# load balancers probe /health there the same way.
SECURE_REDIRECT_EXEMPT = [r"^internal/", r"^(v1/)?health$"]
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = True
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
