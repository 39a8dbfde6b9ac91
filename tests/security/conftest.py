from tests.platform.conftest import key_client, member_client, tenant_a, tenant_b  # noqa: F401 - shared fixtures

FIGURES: list[str] = []  # lines the security tests measured, shown in the run's summary (CI's output too)


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("security figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
