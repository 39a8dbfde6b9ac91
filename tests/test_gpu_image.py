"""The GPU suite's picture of the bare image (benchmarks/gpu_bare_env.py, benchmarks/gpu_wheels.py): every
third-party module that the engine, the kernels, the adapters and their GPU tests import is either on the image
or carried as a wheel. Without them the engine does not even import on an H200."""

import ast
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_bare_env  # noqa: E402
import gpu_wheels  # noqa: E402

FOLDERS = ["engine", "kernels", "adapters", "tests/engine", "tests/kernels"]
OURS = {"engine", "kernels", "adapters", "tests", "benchmarks"}


def _imported_top_level() -> dict[str, str]:
    """Top-level module -> a file importing it at module level (the GPU suite collects these files)."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.parse(path.read_text(), filename=str(path)).body:
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in OURS:
                        found.setdefault(top, str(path.relative_to(REPO)))
    return found


def test_carried_wheels_cover_what_the_image_lacks_and_nothing_it_has():
    wanted = {gpu_bare_env.normalized(line.split("=")[0].split("[")[0]) for line in gpu_wheels.wanted()}
    engine = gpu_wheels.pins(REPO / "requirements/engine.txt")
    image_names = {gpu_wheels.FOR_THE_IMAGE.get(name, name) for name in engine}  # nixl-cu12 -> the image's nixl-cu13
    assert {name for name in image_names if name not in gpu_bare_env.IMAGE} <= wanted
    assert "jsonschema" in wanted  # tests/engine/test_structured.py
    assert not wanted & gpu_bare_env.IMAGE  # torch, numpy, ...: never shadowed


def test_every_module_the_gpu_suite_imports_is_on_the_image_or_carried():
    dists = {gpu_bare_env.normalized(d.metadata["Name"]): d for d in importlib.metadata.distributions()
             if d.metadata["Name"]}
    wanted = {gpu_bare_env.normalized(line.split("=")[0].split("[")[0]) for line in gpu_wheels.wanted()}
    reachable = gpu_bare_env.with_requirements(frozenset(gpu_bare_env.IMAGE | wanted), dists)
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in _imported_top_level().items():
        names = {gpu_bare_env.normalized(d) for d in providers.get(module, [])}
        if not names & reachable:
            missing[module] = where
    assert missing == {}, "add these to requirements/engine.txt (they are carried from there) or import lazily"


def test_the_dry_run_stubs_what_the_image_lacks(tmp_path):
    stubbed = gpu_bare_env.write_stubs(tmp_path / "stubs")
    for module in ("llguidance", "celery", "kombu", "starlette", "jsonschema", "django"):
        assert module in stubbed
    assert not {"torch", "triton", "transformers", "peft", "numpy", "httpx"} & set(stubbed)
    (tmp_path / "front" / "kombu").mkdir(parents=True)  # a carried wheel's module, in front of the stubs
    (tmp_path / "front" / "kombu" / "__init__.py").write_text("CARRIED = True\n")
    check = ("import importlib.metadata, importlib.util, kombu, torch\n"
             "assert importlib.metadata.version('torch')\n"
             "assert kombu.CARRIED and importlib.util.find_spec('celery') is None\n"
             "try:\n    import llguidance\nexcept ModuleNotFoundError:\n    print('hidden')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'front'}:{tmp_path / 'stubs'}"}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "hidden\n"), done.stderr
