"""The ecosystem's load tools run against the stack as an operator would run them, unmodified and with no body
overrides: guidellm (pinned in requirements/dev.txt) for a short synchronous and a short concurrent profile. It checks
`GET /health` first, sends vLLM's `ignore_eos` with every request and counts tokens with the model's own tokenizer
(the demo model's folder: nothing is downloaded). Any error, refused or failed request fails the test, and each
request's output is the length asked for, as the server's usage counts it."""

import json
import os
import subprocess
import sys

import pytest

from tests.gateway.structured.conftest import BASE_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

PROMPT_TOKENS, OUTPUT_TOKENS = 32, 16
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def guidellm(demo_stack, tmp_path, *, profile: str, requests: int) -> dict:
    """One `guidellm run` of `requests` requests under `profile`; its JSON report."""
    report = tmp_path / "report.json"
    target = demo_stack.gateway.removesuffix("/v1")
    command = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={target},model={BASE_MODEL},api_key={demo_stack.keys['main']},timeout=60",
        "--profile", profile,
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={demo_stack.model_dir}",
        "--output", f"kind=json,path={report}", "--output", "kind=console", "--disable-progress",
    ]  # fmt: skip
    run = subprocess.run(command, env=os.environ | OFFLINE, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    (tmp_path / "guidellm.log").write_text(run.stdout + run.stderr)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize(("profile", "requests"), [("kind=synchronous", 6), ("kind=concurrent,streams=4", 16)],
                         ids=["synchronous", "concurrent"])  # fmt: skip
def test_guidellm_runs_unmodified_without_an_error(demo_stack, tmp_path, profile, requests):
    report = guidellm(demo_stack, tmp_path, profile=profile, requests=requests)
    (benchmark,) = report["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (requests, 0, 0), totals
