"""What the API documentation says about each operation: a human summary per operation, the resource tag it is
grouped under, and a description made of the view's own docstring (never one inherited from a base class) and who
may call it. Operations that set `extend_schema(summary=..., description=...)` keep theirs."""

from quilt.openai_schema import add_v1_paths

# First path segment after /api/v1/ -> tag (the resource the docs group the operation under).
TAGS = {
    "tenant": "Tenant", "tenants": "Tenants (staff)", "plans": "Plans (staff)", "members": "Members",
    "invitations": "Members", "audit": "Audit log", "keys": "API keys", "base-models": "Adapters",
    "adapters": "Adapters", "usage": "Usage", "usage.csv": "Usage", "requests": "Request log",
    "requests.csv": "Request log", "invoices": "Billing", "reports": "Billing", "fleet": "Fleet (staff)",
}  # fmt: skip
TAG_DESCRIPTIONS = {
    "Tenant": "The caller's own tenant: its settings, webhook secret and audit log.",
    "Tenants (staff)": "Every tenant on the platform; platform staff only.",
    "Plans (staff)": "Plans: prices, limits and minimum charge; platform staff only.",
    "Members": "Who belongs to the tenant and with what role; invitations.",
    "Audit log": "Every change, who made it and when.",
    "API keys": "Keys for the inference and management APIs: scopes, expiry, rotation, their own budgets and limits.",
    "Adapters": "LoRA adapters: upload versions, promote (hot-swap) and roll back; the base models they run on.",
    "Usage": "Tokens and spend, grouped by day, model or key.",
    "Request log": "One row per request: key, model, adapter version, status, tokens, timings and cost.",
    "Billing": "Monthly invoices (JSON or CSV) and the staff margin report.",
    "Fleet (staff)": "The GPU fleet's economics: cost, break-even against an API price, capacity; staff only.",
    "Inference (OpenAI-compatible)": "The OpenAI-compatible inference API under /v1, for the `openai` package or "
    "any OpenAI client: `base_url` is this server's /v1, the key goes in `Authorization: Bearer`.",
    "Fine-tuning (OpenAI-compatible)": "OpenAI's Files and Fine-tuning APIs under /v1: upload JSONL training "
    "data, start a job, follow its events and checkpoints; the result is a new version of an adapter.",
}

# (method, path) -> summary
SUMMARIES = {
    ("GET", "/api/v1/adapters"): "List adapters",
    ("POST", "/api/v1/adapters"): "Upload a new adapter",
    ("GET", "/api/v1/adapters/{name}"): "Get an adapter",
    ("DELETE", "/api/v1/adapters/{name}"): "Delete an adapter",
    ("POST", "/api/v1/adapters/{name}/promote"): "Promote a version (hot-swap)",
    ("POST", "/api/v1/adapters/{name}/rollback"): "Roll back to the previous version",
    ("GET", "/api/v1/adapters/{name}/versions"): "List an adapter's versions",
    ("POST", "/api/v1/adapters/{name}/versions"): "Upload a new version of an adapter",
    ("GET", "/api/v1/audit"): "List the platform's audit log",
    ("GET", "/api/v1/base-models"): "List base models",
    ("GET", "/api/v1/invitations"): "List pending invitations",
    ("POST", "/api/v1/invitations/{invitation_id}/revoke"): "Revoke an invitation",
    ("GET", "/api/v1/invitations/{token}"): "Look at an invitation",
    ("POST", "/api/v1/invitations/{token}"): "Accept an invitation",
    ("GET", "/api/v1/invoices"): "List invoices",
    ("GET", "/api/v1/invoices/{invoice_id}"): "Get an invoice with its lines",
    ("GET", "/api/v1/invoices/{invoice_id}.csv"): "Download an invoice as CSV",
    ("GET", "/api/v1/keys"): "List API keys",
    ("POST", "/api/v1/keys"): "Create an API key",
    ("GET", "/api/v1/keys/{key_id}"): "Get an API key",
    ("POST", "/api/v1/keys/{key_id}/revoke"): "Revoke an API key",
    ("POST", "/api/v1/keys/{key_id}/rotate"): "Rotate an API key",
    ("GET", "/api/v1/members"): "List members",
    ("POST", "/api/v1/members"): "Invite a member",
    ("GET", "/api/v1/members/{member_id}"): "Get a member",
    ("PATCH", "/api/v1/members/{member_id}"): "Change a member's role",
    ("DELETE", "/api/v1/members/{member_id}"): "Remove a member",
    ("GET", "/api/v1/plans"): "List plans",
    ("POST", "/api/v1/plans"): "Create a plan",
    ("GET", "/api/v1/plans/{slug}"): "Get a plan",
    ("PATCH", "/api/v1/plans/{slug}"): "Change a plan",
    ("GET", "/api/v1/reports/margin"): "Revenue, GPU cost and margin per tenant",
    ("GET", "/api/v1/requests.csv"): "Download the request log as CSV",
    ("GET", "/api/v1/tenant"): "Get the caller's tenant",
    ("PATCH", "/api/v1/tenant"): "Change the tenant's settings",
    ("GET", "/api/v1/tenant/audit"): "List the tenant's audit log",
    ("POST", "/api/v1/tenant/webhook-secret"): "Set the webhook secret",
    ("GET", "/api/v1/tenants"): "List tenants",
    ("POST", "/api/v1/tenants"): "Create a tenant",
    ("GET", "/api/v1/tenants/{slug}"): "Get a tenant",
    ("PATCH", "/api/v1/tenants/{slug}"): "Change a tenant (plan, status)",
    ("GET", "/api/v1/usage"): "Usage by day, model or key",
    ("GET", "/api/v1/usage.csv"): "Download usage as CSV",
    ("GET", "/api/v1/fleet/economics"): "Cost per million tokens and utilisation over a window",
    ("GET", "/api/v1/fleet/break-even"): "Break-even against an API's price",
    ("GET", "/api/v1/fleet/capacity"): "Engines needed for a target load",
}


def tag_for(path: str) -> str:
    """The resource an /api/v1 path belongs to; a segment with no tag here yet gets its own, by its name."""
    segment = path.removeprefix("/api/v1/").split("/")[0]
    return TAGS.get(segment) or segment.replace("-", " ").replace("_", " ").capitalize()


def summary_for(method: str, path: str) -> str:
    """The written summary, or one made from the method and path for an operation nobody has named yet."""
    if (method, path) in SUMMARIES:
        return SUMMARIES[(method, path)]
    words = [part.replace("-", " ").replace("_", " ") for part in path.removeprefix("/api/v1/").split("/")
             if part and not part.startswith("{")]  # fmt: skip
    verb = {"GET": "Get", "POST": "Create", "PUT": "Set", "PATCH": "Change", "DELETE": "Delete"}.get(method, method)
    return f"{verb} {' '.join(words)}"


def access_text(view, method: str) -> str:
    """Who may call it, in a sentence: the role a console session needs and the scope an API key needs."""
    from tenancy.api_base import StaffAPIView, TenantAPIView

    if isinstance(view, StaffAPIView):
        return "Platform staff only (a staff user's session or API key)."
    if not isinstance(view, TenantAPIView):
        return ""
    role = view.required_roles.get(method, "admin")
    scope = view.required_scopes.get(method, "admin")
    key = f"an API key with the `{scope}` scope" if scope else "any of the tenant's API keys"
    return f"Needs the {role} role (console session) or {key}."


def own_docstring(view, method: str) -> str:
    """The method's or the view class's own docstring; a base class's is about the code, not the operation."""
    handler = getattr(type(view), method.lower(), None)
    for doc in (getattr(handler, "__doc__", None), type(view).__dict__.get("__doc__")):
        if doc and doc.strip():
            return " ".join(doc.split())
    return ""


def openai_paths(result, generator, request, public):
    """drf-spectacular postprocessing hook: adds the /v1 operations (quilt.openai_schema) and the tags' descriptions."""
    add_v1_paths(result)
    used = {tag for operations in result["paths"].values() for operation in operations.values()
            for tag in operation.get("tags", [])}  # fmt: skip
    result["tags"] = [{"name": name, "description": TAG_DESCRIPTIONS.get(name, "")} for name in
                      [*[name for name in TAG_DESCRIPTIONS if name in used], *sorted(used - TAG_DESCRIPTIONS.keys())]]
    return result
