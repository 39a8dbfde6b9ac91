"""Loaded only into a test worker (`celery worker --include`): it stalls once a validation has been claimed,
so the test can kill the worker at exactly that point, as a crash or an OOM kill would."""

import time

from registry.signals import adapter_version_status_changed


def _stall_once_claimed(sender, version, **kwargs):
    if version.status == "validating":
        time.sleep(600)


adapter_version_status_changed.connect(_stall_once_claimed)
