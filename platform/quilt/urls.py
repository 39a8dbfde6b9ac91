from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from gateway.health_views import health

handler400 = "quilt.api_errors.bad_request"
handler404 = "quilt.api_errors.page_not_found"
handler500 = "quilt.api_errors.server_error"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("health", health, name="health"),  # load balancers and load tools: no key (gateway.health)
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularRedocView.as_view(url_name="schema", template_name="api_docs/redoc.html"),
         name="api-docs"),
    path("api/docs/swagger/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs-swagger"),
    path("api/v1/", include("tenancy.urls")),
    path("api/v1/", include("apikeys.urls")),
    path("api/v1/", include("registry.urls")),
    path("api/v1/", include("metering.urls")),
    path("api/v1/", include("billing.urls")),
    path("api/v1/", include("fleet.urls")),
    path("v1/", include("gateway.urls")),
    path("internal/", include("gateway.internal_urls")),
    path("v1/", include("finetuning.urls")),
    path("", include("console.urls")),
]
