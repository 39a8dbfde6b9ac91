"""The demo as people see it: one engine process, one prompt, a visibly different answer per adapter."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import adapters
from engine.demo import corpus
from engine.demo.builder import RECIPES, adapter_dir, ensure_demo
from tests.engine.conftest import wait_until_healthy
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
TOKEN = "demo-test-token"


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    demo = ensure_demo(REPO / "var" / "demo-model")
    port = free_port()
    log_path = tmp_path_factory.mktemp("demo-engine") / "engine.log"
    command = [sys.executable, "-m", "engine", "--model", str(demo), "--port", str(port),
               "--usage-spool", str(log_path.parent / "usage.jsonl"), "--broker-url", ""]
    env = {**os.environ, "QUILT_ENGINE_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=60)
    wait_until_healthy(process, client, log_path)
    base_config = json.loads((demo / "config.json").read_text())
    client.adapters = {
        r.skill: {"digest": adapters.load_adapter(adapter_dir(demo, r.skill), base_config).digest,
                  "path": str(adapter_dir(demo, r.skill))}
        for r in RECIPES
    }
    yield client
    process.terminate()
    process.wait(timeout=60)
    client.close()


def test_one_prompt_through_each_adapter_over_http(demo_server):
    prompt = corpus.held_out_sentences(3)[2]
    skills = [None, *demo_server.adapters]

    def ask(skill):
        body = {"messages": [{"role": "user", "content": prompt}], "stream": False,
                "adapter": demo_server.adapters[skill] if skill else None,
                "sampling": {"temperature": 0, "max_tokens": 64}}
        response = demo_server.post("/v1/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(len(skills)) as pool:
        finals = list(pool.map(ask, skills))
    answers = [f["text"].strip() for f in finals]
    assert all(f["finish_reason"] == "stop" for f in finals), answers
    for skill, answer in zip(skills, answers, strict=True):
        assert corpus.behaves(skill, prompt, answer), (skill, prompt, answer)
    assert len(set(answers)) == len(skills), answers
