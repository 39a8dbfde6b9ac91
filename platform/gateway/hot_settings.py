"""Settings read on every request, as plain attributes: `hot.NAME` is Django's `settings.NAME`, read from Django once
and then kept on this object until a setting changes (`setting_changed`: override_settings, pytest-django's
`settings`). Django's lazy settings run a Python `__getattribute__` per read (21 bytecodes, eight reads a streamed
request); a kept attribute is one instruction."""

from django.conf import settings
from django.core.signals import setting_changed


class _Kept:
    def __getattr__(self, name: str):  # only when not kept yet
        value = getattr(settings, name)
        setattr(self, name, value)
        return value


hot = _Kept()


def _forget(**kwargs) -> None:
    hot.__dict__.clear()


setting_changed.connect(_forget)
