import pytest

from tests.platform.conftest import key_client, member_client, tenant_a, tenant_b  # noqa: F401 - shared fixtures

FIGURES: list[str] = []  # lines the security tests measured, shown in the run's summary (CI's output too)


@pytest.fixture(autouse=True)
def report_figures(request):
    """Hands the lines a test added to FIGURES to its report, which reaches the run's summary from an xdist worker
    too (tests/conftest.py prints them)."""
    start = len(FIGURES)
    yield
    request.node.user_properties.extend(("figure", line) for line in FIGURES[start:])
