"""Settings read per request are kept as plain attributes, and a changed setting is read again."""

from django.test import override_settings

from gateway.hot_settings import hot
from gateway.request_guard import body_limit


def test_a_kept_setting_follows_a_change_and_its_end():
    before = body_limit(method="POST", path="/v1/completions")  # read and kept
    with override_settings(QUILT_MAX_REQUEST_BYTES=before + 7):
        assert body_limit(method="POST", path="/v1/completions") == before + 7
        assert hot.QUILT_MAX_REQUEST_BYTES == before + 7
    assert body_limit(method="POST", path="/v1/completions") == before


def test_pytest_djangos_settings_fixture_is_followed(settings):
    assert hot.QUILT_KEY_CACHE_SECONDS == settings.QUILT_KEY_CACHE_SECONDS
    settings.QUILT_KEY_CACHE_SECONDS = 12345
    assert hot.QUILT_KEY_CACHE_SECONDS == 12345
