"""Every setting, environment-driven through django-environ. Overlays (dev, test, production) stay small.

With no environment set this is the embedded default: SQLite and a local broker under var/, an in-process
channel layer and cache. Production points DATABASE_URL, REDIS_URL and CELERY_BROKER_URL at real servers.
"""

from pathlib import Path

import environ
from celery.schedules import crontab
from django.core.exceptions import ImproperlyConfigured

REPO_ROOT = Path(__file__).resolve().parents[3]
VAR_DIR = REPO_ROOT / "var"
VAR_DIR.mkdir(exist_ok=True)

env = environ.Env()

SECRET_KEY = env("SECRET_KEY", default="dev-insecure-quilt-secret-key-change-me-in-production-0123456789")
DEBUG = env.bool("DEBUG", default=False)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework_api_key",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # ReDoc and Swagger UI served from our static files: /api/docs/ works offline
    "channels",
    "django_celery_beat",
    "django_htmx",
    "axes",
    "tenancy",
    "apikeys",
    "registry",
    "metering",
    "billing",
    "gateway",
    "fleet",
    "console",
    "finetuning",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "quilt.middleware.RefuseNulInUrlMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "axes.middleware.AxesMiddleware",
]

AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]

ROOT_URLCONF = "quilt.urls"
ASGI_APPLICATION = "quilt.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [REPO_ROOT / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]



def database(url: str) -> dict:
    """One database's settings. Under the ASGI server each request may run on a thread of its own, so a connection
    kept past its request (CONN_MAX_AGE > 0) is a connection leaked: they close with their request (0), and the
    few long-lived executor threads of the gateway keep one each, checked before reuse."""
    config = env.db_url_config(url)
    config["ATOMIC_REQUESTS"] = False
    config["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=0)
    config["CONN_HEALTH_CHECKS"] = True
    if config["ENGINE"] == "django.db.backends.sqlite3":
        # Several processes (gateway, worker) share the file: wait for locks instead of failing at once.
        config.setdefault("OPTIONS", {}).update({"timeout": 30, "transaction_mode": "IMMEDIATE"})
    return config


DATABASES = {"default": database(env("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'quilt.sqlite3'}"))}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env("REDIS_URL", default="")

if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL,
            "OPTIONS": {"pool_class": "quilt.redis_pool.SharedConnectionPool"},  # not a connection per request
        }
    }  # fmt: skip
    CHANNEL_LAYERS = {
        # redis-py 8 gives up on a read after 5 s by default, exactly as long as channels_redis's blocking pop
        # waits: under load the read lost the race and every idle websocket dropped. Reads outlast the pop.
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                    "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 15}]}}
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Celery: the embedded default is kombu's SQLAlchemy transport on a SQLite file, which works across processes
# with no server running.
CELERY_BROKER_URL = env("CELERY_BROKER_URL", default=f"sqla+sqlite:///{VAR_DIR / 'celery-broker.sqlite3'}")
CELERY_RESULT_BACKEND = env("CELERY_RESULT_BACKEND", default=None)
CELERY_TASK_DEFAULT_QUEUE = env("CELERY_TASK_DEFAULT_QUEUE", default="celery")
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# A task a killed worker took but never acknowledged goes back to a Redis queue after the visibility timeout,
# found by a sweep of any live worker every few seconds (kombu's default is an hour). Tasks are idempotent;
# one that runs longer than the timeout may be delivered twice.
REDIS_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env.int("CELERY_VISIBILITY_TIMEOUT_SECONDS", default=50),
    "unacked_restore_interval": 5, "unacked_restore_throttle": 1,
}  # fmt: skip
if CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
    CELERY_BROKER_TRANSPORT_OPTIONS = REDIS_BROKER_TRANSPORT_OPTIONS
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
# Periodic tasks: one dict, each app adds its own entries (synced into django_celery_beat by the scheduler).
CELERY_BEAT_SCHEDULE = {
    "registry-requeue-stale-validations": {"task": "registry.requeue_stale_validations", "schedule": 300.0},
    "registry-collect-adapter-blobs": {"task": "registry.collect_adapter_blobs", "schedule": 3600.0},
    "metering-rollup-usage": {"task": "metering.rollup_usage", "schedule": 300.0},
    "metering-purge-request-bodies": {"task": "metering.purge_request_bodies", "schedule": 3600.0},
    "billing-issue-invoices": {"task": "billing.issue_invoices", "schedule": crontab(minute=0, hour=3, day_of_month=1)},
}
CELERY_TIMEZONE = "UTC"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)
MEDIA_ROOT = Path(env("MEDIA_ROOT", default=str(VAR_DIR / "media")))
MEDIA_URL = "media/"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
if env("AWS_STORAGE_BUCKET_NAME", default=""):
    # Adapter blobs in S3 (or an S3-compatible store at AWS_S3_ENDPOINT_URL); credentials from boto3's own chain
    # (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a pod's web identity, an instance profile). Engines download what
    # they serve through signed URLs (registry.storage.canonical_urls): no volume is shared with them.
    STORAGES["default"] = {"BACKEND": "storages.backends.s3.S3Storage", "OPTIONS": {
        "bucket_name": env("AWS_STORAGE_BUCKET_NAME"),
        "region_name": env("AWS_S3_REGION_NAME", default="") or None,
        "endpoint_url": env("AWS_S3_ENDPOINT_URL", default="") or None,
        "signature_version": "s3v4",
        "querystring_auth": True,
        "file_overwrite": True,
    }}  # fmt: skip

LOGIN_URL = "console:login"
CSRF_FAILURE_VIEW = "console.views.csrf.csrf_failure"
LOGIN_REDIRECT_URL = "console:overview"
LOGOUT_REDIRECT_URL = "console:login"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apikeys.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "quilt.schema.QuiltAutoSchema",
    "EXCEPTION_HANDLER": "quilt.api_errors.exception_handler",
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "quilt.negotiation.StrictContentNegotiation",
    # JSON bodies, as the schema says (a form is a 415); the adapter uploads take multipart (registry.api).
    "DEFAULT_PARSER_CLASSES": ["quilt.parsers.QuiltJSONParser"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    # No OPTIONS metadata (405): it was rendered through the CSV renderer too, and no client of ours needs it.
    "DEFAULT_METADATA_CLASS": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Quilt management API",
    "DESCRIPTION": "Tenants, members, API keys, adapters, usage, the request log and billing under /api/v1; the "
    "OpenAI-compatible inference and fine-tuning API under /v1. Management request bodies are JSON (the adapter "
    "uploads multipart), amounts are decimal strings, and each refusal's status says what it is: 400 a request "
    "the schema does not allow, 409 the object's state, 422 a rule the schema can not state.",
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "quilt.schema_text.openai_paths",
                            "quilt.schema.describe_refusals"],
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "REDOC_DIST": "SIDECAR",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_UI_SETTINGS": {"theme": {"typography": {"fontFamily": "system-ui, sans-serif",
                                                   "headings": {"fontFamily": "system-ui, sans-serif"}}}},
    # Several models have a `status` field; name their enums instead of letting them collide.
    "ENUM_NAME_OVERRIDES": {
        "TenantStatusEnum": "tenancy.models.Tenant.Status",
        "InvoiceStatusEnum": "billing.models.Invoice.Status",
        "BaseModelStatusEnum": "registry.models.BaseModel.Status",
        "AdapterVersionStatusEnum": "registry.models.AdapterVersion.Status",
        "WarmTierEnum": "tenancy.models.WarmTier",
    },
}

AXES_FAILURE_LIMIT = env.int("AXES_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = 0.25  # hours
AXES_RESET_ON_SUCCESS = True
# Lock out a username from an address, not an address: failures for made-up names lock no real user out.
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_LOCKOUT_TEMPLATE = "console/lockout.html"

EMAIL_BACKEND = env("EMAIL_BACKEND", default="django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = env("DEFAULT_FROM_EMAIL", default="quilt@localhost")

# Quilt's own knobs.
QUILT_ENGINE_TOKEN = env("QUILT_ENGINE_TOKEN", default="dev-engine-token")
# How long a gateway process keeps a verified key and a resolved model. With Redis, every committed change to a key,
# tenant, plan, membership, price or model is announced and clears them at once (apikeys.auth_changes), so the
# lifetime only bounds an announcement that was lost; without Redis it is the only bound.
QUILT_KEY_CACHE_SECONDS = env.float("QUILT_KEY_CACHE_SECONDS", default=30.0 if REDIS_URL else 1.0)
QUILT_METRICS_TOKEN = env("QUILT_METRICS_TOKEN", default="")  # the gateway's /metrics; empty: no endpoint
QUILT_KEY_LAST_USED_INTERVAL_SECONDS = env.int("QUILT_KEY_LAST_USED_INTERVAL_SECONDS", default=60)
QUILT_MAX_UPLOAD_BYTES = env.int("QUILT_MAX_UPLOAD_BYTES", default=2 * 1024**3)
# Uploads stream to temporary files past this size (adapter uploads always do: see registry.upload_handlers).
FILE_UPLOAD_MAX_MEMORY_SIZE = env.int("FILE_UPLOAD_MAX_MEMORY_SIZE", default=256 * 1024)
QUILT_ADAPTER_MAX_RANK = env.int("QUILT_ADAPTER_MAX_RANK", default=256)
QUILT_ADAPTER_VALIDATION_LEASE_SECONDS = env.int("QUILT_ADAPTER_VALIDATION_LEASE_SECONDS", default=600)
QUILT_ADAPTER_VALIDATION_MAX_ATTEMPTS = env.int("QUILT_ADAPTER_VALIDATION_MAX_ATTEMPTS", default=3)
QUILT_ADAPTER_GC_GRACE_SECONDS = env.int("QUILT_ADAPTER_GC_GRACE_SECONDS", default=3600)
# With S3, engines download adapters through signed URLs valid this long. The gateway keeps a model's URLs as long as
# its resolved model (QUILT_KEY_CACHE_SECONDS), so this must be well past that.
QUILT_ADAPTER_URL_SECONDS = env.int("QUILT_ADAPTER_URL_SECONDS", default=900)
if QUILT_ADAPTER_URL_SECONDS < 4 * QUILT_KEY_CACHE_SECONDS:
    raise ImproperlyConfigured("QUILT_ADAPTER_URL_SECONDS must be at least 4 x QUILT_KEY_CACHE_SECONDS: a gateway "
                               "hands an adapter's signed URLs for as long as it keeps the resolved model")
# With a remote storage that signs no URLs, canonical adapters are mirrored here for engines on this machine.
QUILT_ADAPTER_CACHE_DIR = Path(env("QUILT_ADAPTER_CACHE_DIR", default=str(VAR_DIR / "adapter-cache")))
# Where a process without a shared channel layer (the embedded demo's worker) relays live pushes: the web server's
# /internal/live-relay/ (set by `manage.py demo`; empty with Redis, whose channel layer reaches every process).
QUILT_LIVE_RELAY_URL = env("QUILT_LIVE_RELAY_URL", default="")
# The inference gateway: admission runs in Redis when REDIS_URL is set, else in the database.
QUILT_REDIS_KEY_PREFIX = env("QUILT_REDIS_KEY_PREFIX", default="quilt")
QUILT_HOLD_TTL_SECONDS = env.int("QUILT_HOLD_TTL_SECONDS", default=900)  # an orphaned budget hold expires
# A gateway's admission command that Redis has not answered in this long fails (a 503 before the answer; after it, the
# answer ends as served and the hold is left to metering's settle): a paused or cut-off Redis never hangs a request.
QUILT_REDIS_REPLY_TIMEOUT_SECONDS = env.float("QUILT_REDIS_REPLY_TIMEOUT_SECONDS", default=5.0)
# A gateway process admits a busy key's requests from a share of its limits held ahead (gateway.admission.leases):
# no Redis round trip each; refusals never late, early by at most other processes' unused shares. False: every
# request admitted by its own script, refusals exact across processes.
QUILT_ADMISSION_LEASES = env.bool("QUILT_ADMISSION_LEASES", default=True)
# Admission counts prompt tokens with the base model's tokenizer; prompts past this size on a worker thread.
QUILT_TOKENIZE_ABOVE_BYTES = env.int("QUILT_TOKENIZE_ABOVE_BYTES", default=16384)
# Counts of tenants' long prompt segments kept (a chat's system prompt, earlier turns): characters per base model.
QUILT_KEPT_SEGMENT_CHARS = env.int("QUILT_KEPT_SEGMENT_CHARS", default=2_000_000)
QUILT_ENGINE_CONNECT_TIMEOUT_SECONDS = env.float("QUILT_ENGINE_CONNECT_TIMEOUT_SECONDS", default=2.0)
QUILT_ENGINE_READ_TIMEOUT_SECONDS = env.float("QUILT_ENGINE_READ_TIMEOUT_SECONDS", default=300.0)
QUILT_ENGINE_HEALTH_INTERVAL_SECONDS = env.int("QUILT_ENGINE_HEALTH_INTERVAL_SECONDS", default=5)
# Disaggregated prefill/decode (docs/kv-tiers.md): a prompt whose part not cached on the decode engine is estimated
# at fewer tokens than this skips the prefill hop (llm-d's rule); the prefill hop's time limit and its lease's TTL.
QUILT_PREFILL_HOP_MIN_UNCACHED_TOKENS = env.int("QUILT_PREFILL_HOP_MIN_UNCACHED_TOKENS", default=256)
QUILT_PREFILL_HOP_TIMEOUT_SECONDS = env.float("QUILT_PREFILL_HOP_TIMEOUT_SECONDS", default=30.0)
QUILT_KV_LEASE_TTL_SECONDS = env.int("QUILT_KV_LEASE_TTL_SECONDS", default=30)
# Images in chat requests to a vision-language base (docs/models.md): at most this many per request, each at most
# this many bytes decoded and this many pixels before the model's processor resizes it; larger is a 400.
QUILT_IMAGES_PER_REQUEST = env.int("QUILT_IMAGES_PER_REQUEST", default=8)
QUILT_IMAGE_MAX_BYTES = env.int("QUILT_IMAGE_MAX_BYTES", default=10 * 1024**2)
QUILT_IMAGE_MAX_PIXELS = env.int("QUILT_IMAGE_MAX_PIXELS", default=4096 * 4096)
# An image given as an http(s) URL is refused unless the deployment turns fetching on (a request that makes the
# server fetch a URL is server-side request forgery). Then only hosts on the allowlist are fetched ("images.example"
# exactly, ".example.com" any host under it), at an address that is public (private, loopback, link-local and
# reserved ranges refused, unless inside QUILT_IMAGE_FETCH_ALLOWED_NETWORKS, CIDRs an operator trusts), every
# redirect checked again, within the byte limit above and this timeout for the whole fetch.
QUILT_IMAGE_FETCH = env.bool("QUILT_IMAGE_FETCH", default=False)
QUILT_IMAGE_FETCH_DOMAINS = env.list("QUILT_IMAGE_FETCH_DOMAINS", default=[])
QUILT_IMAGE_FETCH_ALLOWED_NETWORKS = env.list("QUILT_IMAGE_FETCH_ALLOWED_NETWORKS", default=[])
QUILT_IMAGE_FETCH_TIMEOUT_SECONDS = env.float("QUILT_IMAGE_FETCH_TIMEOUT_SECONDS", default=5.0)
QUILT_IMAGE_FETCH_MAX_REDIRECTS = env.int("QUILT_IMAGE_FETCH_MAX_REDIRECTS", default=3)
# Fine-tuning: training runs in its own worker (`celery -A quilt worker -Q training --pool solo`).
QUILT_TRAINING_QUEUE = env("QUILT_TRAINING_QUEUE", default="training")
QUILT_FINE_TUNING_MAX_FILE_BYTES = env.int("QUILT_FINE_TUNING_MAX_FILE_BYTES", default=64 * 1024**2)
QUILT_FINE_TUNING_BASE_LEARNING_RATE = env.float("QUILT_FINE_TUNING_BASE_LEARNING_RATE", default=1e-3)
QUILT_FINE_TUNING_DEFAULT_RANK = env.int("QUILT_FINE_TUNING_DEFAULT_RANK", default=8)
QUILT_FINE_TUNING_CHECKPOINT_STEPS = env.int("QUILT_FINE_TUNING_CHECKPOINT_STEPS", default=50)
QUILT_FINE_TUNING_LEASE_SECONDS = env.int("QUILT_FINE_TUNING_LEASE_SECONDS", default=600)  # no heartbeat: requeued
QUILT_FINE_TUNING_MAX_ATTEMPTS = env.int("QUILT_FINE_TUNING_MAX_ATTEMPTS", default=3)
QUILT_FINE_TUNING_DEVICE = env("QUILT_FINE_TUNING_DEVICE", default="")  # empty: CUDA when there is one, else CPU
QUILT_FINE_TUNING_THREADS = env.int("QUILT_FINE_TUNING_THREADS", default=0)  # 0: torch's default
QUILT_FINE_TUNING_WORK_DIR = env("QUILT_FINE_TUNING_WORK_DIR", default="")  # empty: MEDIA_ROOT/fine-tuning
CELERY_BEAT_SCHEDULE["finetuning-requeue-stale-jobs"] = {"task": "finetuning.requeue_stale_jobs", "schedule": 60.0}
CELERY_BEAT_SCHEDULE["gateway-check-engines"] = {
    "task": "gateway.check_engines", "schedule": float(QUILT_ENGINE_HEALTH_INTERVAL_SECONDS)
}
# Pins follow adapters' and plans' warm tiers, promotions and engine restarts (gateway/pins.py).
CELERY_BEAT_SCHEDULE["gateway-sync-pins"] = {"task": "gateway.sync_pins", "schedule": 60.0}
CELERY_BEAT_SCHEDULE["gateway-reconcile-admission"] = {"task": "gateway.reconcile_admission", "schedule": 300.0}
# A served request whose engine's usage event has not been recorded this long after the gateway settled it is billed
# from the gateway's copy (gateway/unreported.py): its engine died before handing the event to the broker.
QUILT_UNREPORTED_USAGE_GRACE_SECONDS = env.float("QUILT_UNREPORTED_USAGE_GRACE_SECONDS", default=120.0)
CELERY_BEAT_SCHEDULE["gateway-bill-unreported-usage"] = {"task": "gateway.bill_unreported_usage", "schedule": 30.0}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", default="INFO")},
    "loggers": {"httpx": {"level": "WARNING"}},  # the gateway's engine calls: one INFO line per request otherwise
}
AXES_VERBOSE = False
# Invitation links: the address clients reach this platform at, and how long an invitation stays open.
QUILT_PUBLIC_URL = env("QUILT_PUBLIC_URL", default="http://localhost:8000")
QUILT_INVITATION_TTL_SECONDS = env.int("QUILT_INVITATION_TTL_SECONDS", default=7 * 86400)
# The inference API refuses request bodies past this size with a 413 (prompts are far smaller).
QUILT_MAX_REQUEST_BYTES = env.int("QUILT_MAX_REQUEST_BYTES", default=2 * 1024**2)
# Webhook targets must be public addresses; these networks are let through too (e.g. 127.0.0.1/32 in development).
QUILT_WEBHOOK_ALLOWED_NETWORKS = env.list("QUILT_WEBHOOK_ALLOWED_NETWORKS", default=[])
