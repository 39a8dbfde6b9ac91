"""Comments and docs say what the code does and why, never how it got here: no "issue N", "item N", "the sixth
pass" or "a turn ago" in the tracked source. The history is in git."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

HISTORY = re.compile(
    r"\bissues? #?\d+\b(?!\s+invoices?\b)"  # "issue 37" (not the console's "Issue 2 invoices" button)
    r"|\bitems? \d+\b"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth"
    r"|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\d+(?:st|nd|rd|th)) pass(?:es)?\b"
    r"|\ba turn ago\b"
    r"|\b(?:it|they|we|this|that|which|each) used to\b"  # "each used to create its tables" (not "a key used to sign")
    r"|\bthe (?:old|earlier) (?:design|code|gateway|engine|backend|client)\b|\bthe first design\b"
    r"|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}'s\b",  # "5d42326's tiles": a commit as a thing of its own
    re.IGNORECASE,
)

# path prefixes, as regular expressions
EXCLUDED = (
    r"tests/test_no_history_in_source\.py$",  # this test spells the patterns
    r"platform/[^/]+/migrations/",  # generated
    r"benchmarks/RESULTS\.md$",  # a dated log of measurements: which code ran, against which, is the data
)


def excluded(path: str) -> bool:
    return any(re.match(pattern, path) for pattern in EXCLUDED)


def tracked_text_files() -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no tracked files to read")
    return [name for name in listed.stdout.decode().split("\0") if name and not excluded(name)]


def history_lines(paths: list[str], root: Path = REPO) -> list[str]:
    found = []
    for name in paths:
        data = (root / name).read_bytes() if (root / name).is_file() else b""
        if b"\0" in data[:8192]:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{name}:{number}: {line.strip()[:160]}")
    return found


def test_tracked_source_tells_no_history():
    found = history_lines(tracked_text_files())
    assert not found, "say what and why instead (the history is in git):\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "# quantization (issue 20, docs/quantization.md)",
    '"""The gateway\'s counting against the code before issue 37 item 23\'s sixth pass."""',
    "## Issue 37 item 23, thirteenth pass (2026-11-29)",
    "a decode hop was a 400 a turn ago",
    "see the 12th pass",
    "page.wait_for_timeout(5_000)  # it used to retry every 2 s, forever",
    "each used to create its tables on first use",
    "to the heartbeat (the first design) made every process herd",
    "the old gateway still had one reset",
    "per projection the plan and 5d42326's tiles",
])
def test_the_patterns_catch_history(tmp_path, line):
    (tmp_path / "a.py").write_text(f"x = 1\n{line}\n")
    assert history_lines(["a.py"], root=tmp_path) == [f"a.py:2: {line.strip()}"]


@pytest.mark.parametrize("line", [
    "a refusal the schema states (a name outside its pattern) is 400",
    'assert b"Issue 2 invoices" in page.content',
    "the invitation is no longer pending",
    "items = [1, 2]; first = items[0]",
    "the key used to sign the webhook",
    "the first version of an adapter is its own",
    "Measured on the H200 (main 5d42326, benchmarks/gpu-runs/)",
    "the adapter's digest's first 12 characters",
])
def test_the_patterns_leave_ordinary_prose_alone(tmp_path, line):
    (tmp_path / "a.py").write_text(line + "\n")
    assert history_lines(["a.py"], root=tmp_path) == []


def test_exclusions_are_the_generated_migrations_and_this_file():
    assert excluded("platform/billing/migrations/0001_initial.py")
    assert not excluded("platform/gateway/views.py") and not excluded("tests/gateway/test_relay.py")
    assert excluded("tests/test_no_history_in_source.py")
    assert not excluded("platform/billing/services.py")
    assert not excluded("engine/llm_engine.py")
    assert not excluded("docs/gateway-cpu.md")
    assert excluded("benchmarks/RESULTS.md") and not excluded("benchmarks/gateway_overhead.py")
