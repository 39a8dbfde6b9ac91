from tests.platform.conftest import key_client, member_client, tenant_a, tenant_b  # noqa: F401 - shared fixtures
