"""Signals other apps listen to; each is sent after the change has committed."""

from django.dispatch import Signal

# kwargs: adapter, version, previous_version (None when the alias pointed nowhere before)
adapter_version_promoted = Signal()

# kwargs: version (an AdapterVersion whose status just changed)
adapter_version_status_changed = Signal()

# kwargs: adapter (its warm_tier just changed: the engines' pins follow)
adapter_warm_changed = Signal()
