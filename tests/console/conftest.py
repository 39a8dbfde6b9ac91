"""Fixtures for the console: logged-in clients by role, a tiny registered base model, adapters, usage."""

import os

import pytest
from django.test import Client

from registry.base_models import base_model_register
from tenancy.audit import Actor
from tests.conftest import REPO, stop_worker
from tests.console.builders import BASE_NAME, peft_adapter_zip
from tests.console.live import CHROMIUM, CHROMIUM_ARGS, start_live_worker, start_server
from tests.platform.factories import MembershipFactory, TenantFactory, UserFactory
from tests.tiny_llama import save_tiny_base

MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"
ASYNC_UNSAFE = "DJANGO_ALLOW_ASYNC_UNSAFE"


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user, backend=MODEL_BACKEND)
    return client


@pytest.fixture
def tenant(db):
    return TenantFactory(slug="acme", name="Acme Corp")


@pytest.fixture
def other_tenant(db):
    return TenantFactory(slug="globex", name="Globex")


@pytest.fixture
def member_of(db):
    """member_of(tenant, role) -> (client, membership)"""

    def build(tenant, role="owner"):
        membership = MembershipFactory(tenant=tenant, role=role)
        return logged_in(membership.user), membership

    return build


@pytest.fixture
def staff(db):
    return UserFactory(username="ops", is_staff=True)


@pytest.fixture
def staff_client(staff):
    return logged_in(staff)


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def adapter_zips(tmp_path_factory) -> list[bytes]:
    return [peft_adapter_zip(tmp_path_factory.mktemp(f"peft-{seed}"), seed=seed) for seed in (1, 2, 3, 4)]


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture
def media_root(settings, media_dir):
    """One media folder per run, shared with the live server and worker so they see the same blobs."""
    settings.MEDIA_ROOT = str(media_dir)
    return media_dir


@pytest.fixture(scope="session")
def live_server_process(django_db_setup, media_dir):
    server = start_server(media_dir)
    yield server
    server.stop()


@pytest.fixture
def live_server_asgi(transactional_db, live_server_process, request):
    """The live server, for one test on the committed test database. Its teardown runs before that database is
    flushed: it closes the test's browser pages, so that nothing of this test reaches the server any more, then
    waits for the server to finish what is in flight and leave every transaction (see LiveServer.drain)."""
    yield live_server_process
    if "browser" in request.fixturenames:
        for context in request.getfixturevalue("browser").contexts:
            context.close()
    live_server_process.drain()


@pytest.fixture
def live_worker(transactional_db, media_dir):
    worker = start_live_worker(media_dir)
    yield worker
    stop_worker(worker)


@pytest.fixture(scope="module")
def browser():
    """Chromium for one test module. Playwright's sync API keeps an event loop running in this thread while it
    is open, so Django's async-safety guard is lifted for exactly that long (the ORM calls in between are sync)."""
    from playwright.sync_api import sync_playwright

    before = os.environ.get(ASYNC_UNSAFE)
    os.environ[ASYNC_UNSAFE] = "true"
    try:
        with sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            yield chromium
            chromium.close()
    finally:
        if before is None:
            os.environ.pop(ASYNC_UNSAFE, None)
        else:
            os.environ[ASYNC_UNSAFE] = before


@pytest.fixture(scope="session")
def screenshots():
    folder = REPO / "var" / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def base_model(db, tiny_base_dir, media_root):
    return base_model_register(actor=Actor.system(), name=BASE_NAME, checkpoint_dir=tiny_base_dir)
