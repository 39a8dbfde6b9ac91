"""Facts tenancy announces; other apps subscribe, so that tenancy imports none of them."""

from django.dispatch import Signal

# kwargs: tenant_id (int), days (int). A tenant's admins changed how long request bodies are kept (0: not at all);
# metering applies it to the bodies it holds at once, inside the change's transaction (a change that rolls back
# deletes nothing; one that commits leaves no body past the new retention).
body_retention_changed = Signal()
