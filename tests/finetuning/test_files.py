"""The Files API and the checks a fine-tuning file meets, through the `openai` package against the live gateway:
every refusal names the bad line, in OpenAI's error shape."""

import json

import openai
import pytest

from tests.finetuning.conftest import BASE_MODEL, CRAMPED_STORAGE_BYTES, SLOW_RPM, client
from training.demo_data import DATA_DIR, TRAIN_FILE

pytestmark = [pytest.mark.django_db, pytest.mark.slow]


def _chat(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def _jsonl(*records) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()


def _good(count: int) -> list[dict]:
    return [_chat(f"the cat sees a red ball {i}", "ball") for i in range(count)]


def _refused(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as refused:
        call()
    return refused.value


def test_files_are_created_listed_read_and_deleted_for_their_own_tenant_only(ft_stack):
    main, rival = client(ft_stack, "main"), client(ft_stack, "rival")
    content = (DATA_DIR / TRAIN_FILE).read_bytes()
    created = main.files.create(file=("demo.jsonl", content), purpose="fine-tune")
    assert (created.object, created.purpose, created.status, created.bytes) == ("file", "fine-tune", "processed",
                                                                                 len(content))
    assert created.id.startswith("file-")
    assert main.files.retrieve(created.id).filename == "demo.jsonl"
    assert main.files.content(created.id).read() == content
    assert created.id in [f.id for f in main.files.list(purpose="fine-tune")]

    assert created.id not in [f.id for f in rival.files.list()]
    missing = _refused(lambda: rival.files.retrieve(created.id))
    assert missing.status_code == 404 and missing.body["code"] == "not_found"
    assert _refused(lambda: rival.files.delete(created.id)).status_code == 404

    deleted = main.files.delete(created.id)
    assert (deleted.id, deleted.deleted) == (created.id, True)
    assert _refused(lambda: main.files.retrieve(created.id)).status_code == 404


def test_the_files_and_fine_tuning_apis_count_against_the_plans_requests_per_minute(ft_stack):
    slow = client(ft_stack, "slow")
    for _ in range(SLOW_RPM):
        slow.files.list()
    for call in (slow.files.list, slow.fine_tuning.jobs.list):
        refused = _refused(call)
        assert refused.status_code == 429 and refused.body["code"] == "rate_limit_exceeded"
        assert int(refused.response.headers["Retry-After"]) >= 1
        assert refused.response.headers["x-ratelimit-remaining-requests"] == "0"
    client(ft_stack, "main").files.list()  # another tenant is not slowed


def test_files_past_the_plans_storage_quota_are_refused_until_some_are_deleted(ft_stack):
    cramped = client(ft_stack, "cramped")
    content = _jsonl(*_good(10))
    fits = CRAMPED_STORAGE_BYTES // len(content)
    assert fits >= 1
    stored = [cramped.files.create(file=("ten.jsonl", content), purpose="fine-tune") for _ in range(fits)]
    refused = _refused(lambda: cramped.files.create(file=("ten.jsonl", content), purpose="fine-tune"))
    assert refused.status_code == 403 and refused.body["code"] == "file_storage_quota_exceeded"
    assert refused.body["param"] == "file" and str(CRAMPED_STORAGE_BYTES) in refused.body["message"]
    assert len(cramped.files.list().data) == fits  # nothing half-written
    cramped.files.delete(stored[0].id)
    assert cramped.files.create(file=("ten.jsonl", content), purpose="fine-tune").bytes == len(content)


def test_no_key_no_files(ft_stack):
    import openai as sdk

    anonymous = sdk.OpenAI(base_url=ft_stack.gateway, api_key="sk-not-a-key", max_retries=0)
    refused = _refused(lambda: anonymous.files.list())
    assert refused.status_code == 401 and refused.body["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        pytest.param([*_good(2), '{"messages": [', *_good(1)], "line 3: not valid JSON", id="bad-json"),
        pytest.param([*_good(1), {"messages": [{"role": "robot", "content": "hi"}]}],
                     "line 2: messages[0]: role 'robot' is not one of system, user, assistant", id="wrong-role"),
        pytest.param([*_good(3), _chat("the cat sees a red ball", "  ")],
                     "line 4: messages[1]: 'content' is empty", id="empty-answer"),
        pytest.param([*_good(1), {"messages": []}], "line 2: 'messages' must be a non-empty list", id="no-messages"),
        pytest.param([{"messages": [{"role": "user", "content": "only a question"}]}],
                     "line 1: the example has no assistant message to learn from", id="nothing-to-learn"),
        pytest.param([*_good(1), {"input": {"messages": [{"role": "user", "content": "x"}]}}],
                     "line 2: a supervised example needs 'messages'", id="mixed-formats"),
        pytest.param([{"input": {"messages": [{"role": "user", "content": "x"}]},
                       "preferred_output": [{"role": "assistant", "content": "a"}],
                       "non_preferred_output": [{"role": "user", "content": "b"}]}],
                     "line 1: non_preferred_output[0]: role 'user' is not one of assistant", id="dpo-wrong-role"),
    ],
)  # fmt: skip
def test_a_malformed_file_is_refused_with_its_line_number(ft_stack, lines, expected):
    refused = _refused(lambda: client(ft_stack, "main").files.create(file=("bad.jsonl", _jsonl(*lines)),
                                                                      purpose="fine-tune"))  # fmt: skip
    assert refused.status_code == 400
    assert refused.body["code"] == "invalid_file_format" and refused.body["param"] == "file"
    assert expected in refused.body["message"], refused.body["message"]


def test_only_fine_tune_files_are_taken(ft_stack):
    refused = _refused(lambda: client(ft_stack, "main").files.create(file=("a.jsonl", _jsonl(*_good(10))),
                                                                      purpose="batch"))  # fmt: skip
    assert refused.status_code == 400 and refused.body["param"] == "purpose"


def _job_refusal(stack, records, **options) -> openai.APIStatusError:
    tuner = client(stack, "main")
    uploaded = tuner.files.create(file=("data.jsonl", _jsonl(*records)), purpose="fine-tune")
    return _refused(lambda: tuner.fine_tuning.jobs.create(model=BASE_MODEL, training_file=uploaded.id, **options))


def test_a_job_needs_ten_examples(ft_stack):
    refused = _job_refusal(ft_stack, _good(9))
    assert refused.status_code == 400 and refused.body["param"] == "training_file"
    assert "the file has 9 examples; fine-tuning needs at least 10" in refused.body["message"]


def test_an_example_longer_than_the_context_is_refused_with_its_line(ft_stack):
    long = _chat(" ".join(["the old man sees the moon"] * 80), "moon")  # about 480 tokens; the demo holds 256
    refused = _job_refusal(ft_stack, [*_good(6), long, *_good(6)])
    assert refused.status_code == 400 and refused.body["code"] == "invalid_training_file"
    assert "line 7: the example is" in refused.body["message"]
    assert "the model's context holds 256" in refused.body["message"]


def test_a_job_checks_the_file_against_its_method_and_its_options(ft_stack):
    refused = _job_refusal(ft_stack, _good(10), method={"type": "dpo", "dpo": {}})
    assert "line 1: a dpo example needs" in refused.body["message"]
    refused = _job_refusal(ft_stack, _good(10), hyperparameters={"n_epochs": 0})
    assert refused.status_code == 400 and refused.body["param"] == "hyperparameters.n_epochs"
    refused = _job_refusal(ft_stack, _good(10), suffix="not a name!")
    assert refused.body["param"] == "suffix"
    tuner = client(ft_stack, "main")
    refused = _refused(lambda: tuner.fine_tuning.jobs.create(model="no-such-model", training_file="file-nope"))
    assert refused.status_code == 404 and refused.body["param"] == "model"
    refused = _refused(lambda: tuner.fine_tuning.jobs.create(model=BASE_MODEL, training_file="file-nope"))
    assert refused.status_code == 404 and refused.body["param"] == "training_file"


def test_a_file_larger_than_an_inference_request_may_be_is_still_taken(ft_stack):
    """/v1 bodies are capped at QUILT_MAX_REQUEST_BYTES (2 MiB); a fine-tuning upload may be as large as a file may."""
    main = client(ft_stack, "main")
    sentence = "the cat sees a red ball " * 45
    content = _jsonl(*[_chat(f"{sentence}{i}", "ball") for i in range(3000)])
    assert len(content) > 3 * 1024**2
    created = main.files.create(file=("large.jsonl", content), purpose="fine-tune")
    assert (created.status, created.bytes) == ("processed", len(content))
    main.files.delete(created.id)


def _get(stack, tenant: str, path: str):
    import httpx

    return httpx.get(f"{stack.gateway}/{path}", headers={"Authorization": f"Bearer {stack.keys[tenant]}"}, timeout=60)


@pytest.mark.parametrize(("path", "param"), [
    ("files?purpose=bogus", "purpose"), ("files?purpose=", "purpose"), ("files?order=up", "order"),
    ("files?limit=0", "limit"), ("files?limit=101", "limit"), ("files?limit=abc", "limit"), ("files?limit=", "limit"),
    ("files?limit=+5", "limit"), ("files?limit=%D9%A3", "limit"), ("files?limit=99999999999999999999999", "limit"),
    ("files?after=file-nope", "after"), ("files?after=", "after"), ("files?after=%00", "after"),
    ("fine_tuning/jobs?limit=1000", "limit"), ("fine_tuning/jobs?after=ftjob-nope", "after"),
])  # fmt: skip
def test_a_bad_list_parameter_is_400_naming_it(ft_stack, path, param):
    response = _get(ft_stack, "main", path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param) and param in error["message"]


def test_files_of_another_openai_purpose_are_an_empty_list(ft_stack):
    assert client(ft_stack, "main").files.list(purpose="batch").data == []


@pytest.mark.parametrize("path", ["files/%00", "files/file-%00/content", "fine_tuning/jobs/%00",
                                  "fine_tuning/jobs/ftjob-%00/events"])  # fmt: skip
def test_a_nul_character_in_an_id_is_400(ft_stack, path):
    response = _get(ft_stack, "main", path)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_a_cursor_stays_valid_when_its_file_is_deleted(ft_stack):
    rival = client(ft_stack, "rival")
    oldest, middle, newest = (rival.files.create(file=(f"{n}.jsonl", _jsonl(*_good(1))), purpose="fine-tune")
                              for n in ("a", "b", "c"))  # fmt: skip
    assert [f.id for f in rival.files.list(limit=1).data] == [newest.id]
    assert [f.id for f in rival.files.list(limit=1, after=newest.id).data] == [middle.id]
    rival.files.delete(middle.id)  # between two pages
    assert [f.id for f in rival.files.list(limit=1, after=middle.id).data] == [oldest.id]
    assert [f.id for f in rival.files.list(limit=1, after=middle.id, order="asc").data] == [newest.id]


@pytest.mark.parametrize("hyperparameters", [
    '{"learning_rate_multiplier": NaN}', '{"lora_alpha": Infinity}', '{"n_epochs": 1' + "0" * 400 + "}",
    '{"batch_size": 1e400}', '{"lora_rank": -Infinity}',
])  # fmt: skip
def test_a_hyperparameter_that_is_no_finite_number_is_400(ft_stack, hyperparameters):
    import httpx

    tuner = client(ft_stack, "main")
    uploaded = tuner.files.create(file=("data.jsonl", _jsonl(*_good(10))), purpose="fine-tune")
    body = f'{{"model": "{BASE_MODEL}", "training_file": "{uploaded.id}", "hyperparameters": {hyperparameters}}}'
    response = httpx.post(f"{ft_stack.gateway}/fine_tuning/jobs", content=body, timeout=60,
                          headers={"Authorization": f"Bearer {ft_stack.keys['main']}",
                                   "Content-Type": "application/json"})  # fmt: skip
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("hyperparameters.")


def test_a_job_on_another_tenants_file_is_404_as_if_it_did_not_exist(ft_stack):
    theirs = client(ft_stack, "rival").files.create(file=("theirs.jsonl", _jsonl(*_good(10))), purpose="fine-tune")
    tuner = client(ft_stack, "main")
    refused = _refused(lambda: tuner.fine_tuning.jobs.create(model=BASE_MODEL, training_file=theirs.id))
    assert refused.status_code == 404 and refused.body["param"] == "training_file"
    mine = tuner.files.create(file=("mine.jsonl", _jsonl(*_good(10))), purpose="fine-tune")
    refused = _refused(lambda: tuner.fine_tuning.jobs.create(model=BASE_MODEL, training_file=mine.id,
                                                             validation_file=theirs.id))  # fmt: skip
    assert refused.status_code == 404 and refused.body["param"] == "validation_file"


def test_a_job_is_cancelled_once(ft_stack):
    tuner = client(ft_stack, "cancel")
    data = tuner.files.create(file=("data.jsonl", _jsonl(*_good(10))), purpose="fine-tune")
    job = tuner.fine_tuning.jobs.create(model=BASE_MODEL, training_file=data.id, metadata={"team": "search"})
    assert tuner.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    assert [j.id for j in tuner.fine_tuning.jobs.list(metadata={"team": "search"})] == [job.id]
    assert list(tuner.fine_tuning.jobs.list(metadata={"team": "ads"})) == []
    again = _refused(lambda: tuner.fine_tuning.jobs.cancel(job.id))
    assert again.status_code == 400 and again.body["code"] == "job_not_cancellable"
    assert "cancelled" in again.body["message"]
    assert _refused(lambda: client(ft_stack, "rival").fine_tuning.jobs.cancel(job.id)).status_code == 404
    assert tuner.fine_tuning.jobs.retrieve(job.id).status == "cancelled"


@pytest.mark.parametrize(("field", "value", "status"), [
    ("training_file", "file-\x00", 404), ("validation_file", "file-\x00", 404),
    ("metadata", {"team": "a\x00b"}, 400), ("metadata", {"a\x00b": "team"}, 400),
])  # fmt: skip
def test_a_nul_character_in_a_job_field_is_refused_not_a_500(ft_stack, field, value, status):
    tuner = client(ft_stack, "main")
    uploaded = tuner.files.create(file=("data.jsonl", _jsonl(*_good(10))), purpose="fine-tune")
    body = {"model": BASE_MODEL, "training_file": uploaded.id, field: value}
    refused = _refused(lambda: tuner.fine_tuning.jobs.create(**body))
    assert refused.status_code == status and refused.body["param"] == field


def test_the_audit_log_names_files_and_jobs_that_exist_and_the_key_that_made_them(ft_stack):
    from django.urls import reverse

    from apikeys.models import ApiKey
    from tests.console.conftest import logged_in
    from tests.platform.factories import MembershipFactory

    auditor = client(ft_stack, "audit")
    kept = auditor.files.create(file=("kept.jsonl", _jsonl(*_good(12))), purpose="fine-tune")
    gone = auditor.files.create(file=("gone.jsonl", _jsonl(*_good(10))), purpose="fine-tune")
    job = auditor.fine_tuning.jobs.create(model=BASE_MODEL, training_file=kept.id, suffix="audited")
    auditor.fine_tuning.jobs.cancel(job.id)
    auditor.files.delete(gone.id)

    key = ApiKey.objects.get(tenant_id=ft_stack.ids["audit"])
    membership = MembershipFactory(tenant_id=ft_stack.ids["audit"], role="owner")
    page = logged_in(membership.user).get(reverse("console:audit", kwargs={"slug": "ft-audit"}))
    entries = {(entry.action, entry.target_text) for entry in page.context["entries"].rows}
    assert ("fine_tuning_file.create", f"Training file kept.jsonl · {kept.id}") in entries
    assert ("fine_tuning_job.create", f"Fine-tuning job {job.id}") in entries
    assert ("fine_tuning_job.cancel", f"Fine-tuning job {job.id}") in entries
    assert ("fine_tuning_file.delete", f"Training file gone.jsonl · {gone.id} (deleted)") in entries
    text = page.content.decode()
    assert text.count(f"key:{key.prefix}") == len(page.context["entries"].rows) == 5
    assert ">system<" not in text


@pytest.mark.parametrize(("content_type", "body"), [
    ("multipart/form-data", b"purpose=fine-tune"),  # no boundary
    ("multipart/form-data; boundary=", b"--\r\n"),
    ("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n"),
    ("multipart/form-data; boundary=" + "b" * 80, b"--" + b"b" * 80 + b"\r\n"),  # past RFC 2046's 70 characters
])  # fmt: skip
def test_a_multipart_body_that_cannot_be_parsed_is_a_400_in_openais_shape(ft_stack, content_type, body):
    import httpx

    response = httpx.post(f"{ft_stack.gateway}/files", content=body, timeout=60, headers={
        "Authorization": f"Bearer {ft_stack.keys['main']}", "Content-Type": content_type})  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "file", error
    assert "multipart" in error["message"]
