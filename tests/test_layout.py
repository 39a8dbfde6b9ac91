"""The layout rules of DESIGN.md: platform/ is a source root, and the engine side never imports Django."""

import ast
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(code: str, extra_path: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{extra_path}:{REPO}:{REPO / 'platform'}", "HOME": "/tmp"},
    )  # fmt: skip


def _walk_and_check(*packages: str) -> str:
    return (
        "import importlib, pkgutil, sys\n"
        # As on the GPU machine, where Django is not installed: a third-party library may probe for it
        # (kombu does) and carry on, but any import of Django by our own code fails.
        "class NoDjango:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'django' or name.startswith('django.'):\n"
        "            raise ImportError(f'{name} is not installed on the engine side')\n"
        "sys.meta_path.insert(0, NoDjango())\n"
        f"for name in {packages!r}:\n"
        "    package = importlib.import_module(name)\n"
        "    for module in pkgutil.walk_packages(package.__path__, name + '.'):\n"
        "        if not module.name.endswith('__main__'):\n"
        "            importlib.import_module(module.name)\n"
        "leaked = sorted(m for m in sys.modules if m == 'django' or m.startswith('django.'))\n"
        "assert not leaked, leaked\n"
        "print('ok')\n"
    )


def test_platform_folder_is_not_a_package():
    assert (REPO / "platform").is_dir()
    assert not (REPO / "platform" / "__init__.py").exists()


def test_import_platform_is_still_the_standard_library_with_the_project_on_the_path():
    result = _run("import platform, sys; print(platform.system()); print(platform.__file__)")
    assert result.returncode == 0, result.stderr
    system, location = result.stdout.split()
    assert system == "Linux"
    assert not location.startswith(str(REPO))


def test_engine_kernels_adapters_and_training_never_import_django():
    result = _run(_walk_and_check("adapters", "kernels", "engine", "training"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_the_django_guard_catches_a_module_that_imports_django(tmp_path):
    (tmp_path / "leaky").mkdir()
    (tmp_path / "leaky" / "__init__.py").write_text("")
    (tmp_path / "leaky" / "deep.py").write_text("import django.conf\n")
    result = _run(_walk_and_check("leaky"), extra_path=str(tmp_path))
    assert result.returncode != 0
    assert "django" in result.stderr


# The import graph of our own code, read with `ast`: module-level and function-level imports alike (an import
# inside a function that closes a circle is still a circle), `if TYPE_CHECKING:` ones too.

# (folder, the source root its module names start from): every folder of Python in the repository
SOURCES = [(REPO / "engine", REPO), (REPO / "kernels", REPO), (REPO / "adapters", REPO), (REPO / "training", REPO),
           (REPO / "benchmarks", REPO), (REPO / "tests", REPO), (REPO / "platform", REPO / "platform")]

# The engine's layers, by module or subpackage. A module may import its own layer and the layers named here,
# nothing else of ours. Models know the kernels, the LoRA layers and the tensor-parallel collective, never the
# scheduler, the requests or the engine; the scheduler's side knows no model.
ENGINE_LAYERS = {
    "wire": {"engine.contract", "engine.usage"},
    "inputs": {"engine.images", "engine.step_inputs"},  # what a model is given besides tensors
    "requests": {"engine.config", "engine.sampling_params", "engine.sequence", "engine.outputs", "engine.grammar",
                 "engine.tool_calls", "engine.tokenizer", "engine.chat_prompt"},
    "memory": {"engine.paged_memory", "engine.parallel", "engine.lora_modules", "engine.lora_batch",
               "engine.context", "engine.adapter_plan", "engine.adapter_pool", "engine.page_copier", "engine.quantization"},
    "scheduling": {"engine.block_keys", "engine.block_manager", "engine.fairness", "engine.kv", "engine.scheduler"},
    "models": {"engine.models"},
    "runner": {"engine.lora_linear", "engine.rank_model", "engine.cuda_graph", "engine.sampler", "engine.guided",
               "engine.speculative", "engine.model_runner", "engine.workers", "engine.page_budget",
               "engine.output_processor"},
    "engine": {"engine.llm_engine", "engine.llm"},
    "server": {"engine", "engine.__main__", "engine.server", "engine.demo"},
}
ENGINE_MAY_IMPORT = {
    "wire": set(),
    "inputs": set(),
    "requests": {"inputs"},
    "memory": {"kernels", "adapters"},
    "scheduling": {"inputs", "requests", "memory"},
    "models": {"inputs", "memory", "kernels", "adapters"},
    "runner": {"inputs", "requests", "memory", "scheduling", "models", "kernels", "adapters"},
    "engine": {"wire", "inputs", "requests", "memory", "scheduling", "models", "runner", "kernels", "adapters"},
    "server": {"wire", "inputs", "requests", "memory", "scheduling", "models", "runner", "engine", "kernels",
               "adapters"},
}
# Outside the engine: kernels and adapters stand alone, training stands on the engine's tokenizer and adapters;
# nothing of the engine side imports the benchmarks, the tests or the platform.
MAY_IMPORT = {"kernels": set(), "adapters": set(), "engine": {"kernels", "adapters"},
              "training": {"engine", "kernels", "adapters"}}


def source_modules(sources: list[tuple[Path, Path]]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under each folder (migrations aside)."""
    found = {}
    for folder, root in sources:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if "migrations" in parts:
                continue
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph(sources: list[tuple[Path, Path]]) -> dict[str, dict[str, int]]:
    """module -> {module of ours it imports: line of the first such import}."""
    modules = source_modules(sources)

    def ours(name: str) -> str | None:  # the module itself, or the package whose attribute it is
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [ours(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else ours(base) for a in node.names]
            else:
                continue
            for target in targets:
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def engine_unit(module: str) -> str:
    """An engine subpackage counts as one node, a module of the engine's top folder as itself."""
    parts = module.split(".")
    if parts[0] == "engine" and len(parts) > 2:
        return ".".join(parts[:2])
    return module


def engine_layer(module: str) -> str | None:
    unit = engine_unit(module)
    return next((layer for layer, units in ENGINE_LAYERS.items() if unit in units), None)


def describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    return "; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in component for b in sorted(graph[a]) if b in component)


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph(SOURCES)


def test_the_import_graph_reads_every_folder_of_python():
    folders = {d for d in REPO.iterdir() if d.is_dir() and not d.name.startswith(".") and any(d.glob("*.py"))}
    assert folders | {REPO / "platform"} == {folder for folder, _ in SOURCES}


def test_no_module_imports_itself_back_through_others(graph):
    circles = cycles(graph)
    assert not circles, "\n".join(describe(c, graph) for c in circles)


def test_engine_subpackages_import_each_other_one_way(graph):
    units: dict[str, set[str]] = {}
    for module, edges in graph.items():
        if module.startswith("engine"):
            units.setdefault(engine_unit(module), set()).update(
                engine_unit(t) for t in edges if t.startswith("engine") and engine_unit(t) != engine_unit(module))
    circles = cycles(units)
    assert not circles, circles


def test_every_engine_module_has_a_layer(graph):
    unplaced = sorted(m for m in graph if m.split(".")[0] == "engine" and engine_layer(m) is None)
    assert not unplaced, f"add these to ENGINE_LAYERS in {Path(__file__).name}: {unplaced}"


def test_engine_layers_import_downward(graph):
    upward = []
    for module, edges in graph.items():
        top = module.split(".")[0]
        if top not in MAY_IMPORT:
            continue
        layer = engine_layer(module) if top == "engine" else None
        for target, line in edges.items():
            target_top = target.split(".")[0]
            if top != "engine" or target_top != "engine":
                allowed = target_top == top or target_top in MAY_IMPORT[top] | ENGINE_MAY_IMPORT.get(layer, set())
            else:
                target_layer = engine_layer(target)
                allowed = target_layer == layer or target_layer in ENGINE_MAY_IMPORT.get(layer, set())
            if not allowed:
                upward.append(f"{module} ({layer or top}) -> {target} ({engine_layer(target) or target_top}), line {line}")
    assert not upward, "\n".join(upward)


def test_the_import_checks_catch_a_circle_closed_inside_a_function_and_an_upward_import(tmp_path):
    (tmp_path / "engine" / "models").mkdir(parents=True)
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "models" / "__init__.py").write_text("")
    (tmp_path / "engine" / "models" / "llama.py").write_text("from ..scheduler import Scheduler\n")
    (tmp_path / "engine" / "scheduler.py").write_text("def build():\n    from engine.models import llama\n")
    graph = import_graph([(tmp_path / "engine", tmp_path)])
    assert graph["engine.models.llama"] == {"engine.scheduler": 1}
    assert graph["engine.scheduler"] == {"engine.models.llama": 2}
    assert cycles(graph) == [["engine.models.llama", "engine.scheduler"]]
    assert engine_layer("engine.models.llama") == "models"
    assert "scheduling" not in ENGINE_MAY_IMPORT["models"]


# A private name of Python or a dependency (`from re import _parser`, `torch.utils._pytree`) is not its interface: it
# changes without notice. Each that stays says why no public one serves.
PRIVATE_NAMES_ALLOWED = {
    ("kernels/fp8_linear.py", "torch._scaled_mm"): "fp8 x fp8 with per-row scales on CUDA; torch 2.11 has no public op",
    ("kernels/grouped_rows.py", "torch._grouped_mm"): "one call for every group on CPU; torch 2.11 has no public op",
    ("kernels/interpreter.py", "interpreter._patch_lang_tensor"):
        "Triton 3.6's interpreter and numpy >= 2.4 (triton-lang/triton#9171), fixed as upstream fixed it",
    ("benchmarks/decode_launches.py", "torch.utils._python_dispatch"):
        "TorchDispatchMode, the only way to see every op a model dispatches, has no public module",
}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_names(sources: list[tuple[Path, Path]], root: Path = REPO) -> dict[tuple[str, str], int]:
    """(file, private name of a module not ours) -> line, for each name imported from or read off such a module."""
    modules = source_modules(sources)
    ours = {name.split(".")[0] for name in modules}
    found: dict[tuple[str, str], int] = {}
    for path in modules.values():
        relative, tree, foreign = path.relative_to(root).as_posix(), ast.parse(path.read_text()), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] not in ours:
                        foreign.add(alias.asname or alias.name.split(".")[0])
                        if any(private(part) for part in alias.name.split(".")):
                            found.setdefault((relative, alias.name), node.lineno)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] not in ours:
                if any(private(part) for part in node.module.split(".")):
                    found.setdefault((relative, node.module), node.lineno)
                for alias in node.names:
                    foreign.add(alias.asname or alias.name)
                    if private(alias.name):
                        found.setdefault((relative, f"{node.module}.{alias.name}"), node.lineno)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in foreign:
                    found.setdefault((relative, ast.unparse(node)), node.lineno)
    return found


def test_no_private_name_of_python_or_a_dependency_is_used():
    used = {key: line for key, line in private_names(SOURCES).items() if key not in PRIVATE_NAMES_ALLOWED}
    assert not used, "\n".join(f"{path}:{line}: {name}" for (path, name), line in sorted(used.items()))


def test_the_private_name_check_sees_imports_and_attributes(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text(
        "import asyncio\nfrom re import _parser\nimport torch.utils._pytree as pytree\nfrom engine import _ours\n"
        "asyncio.tasks._current_tasks\n"
    )
    found = private_names([(tmp_path / "engine", tmp_path)], root=tmp_path)
    assert sorted(name for _, name in found) == ["asyncio.tasks._current_tasks", "re._parser", "torch.utils._pytree"]
