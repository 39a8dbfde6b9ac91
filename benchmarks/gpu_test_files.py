"""The test files under the given folders that this Python can import, for `pytest -m gpu` on the GPU machine.

    python benchmarks/gpu_test_files.py tests/kernels tests/engine    # prints one path a line

The GPU machine has no Django, and Celery, kombu, starlette, llguidance and jsonschema only as the wheels the
suite carries (docs/gpu.md): a test module that imports something missing at the top cannot even be collected
there, and one such module would stop the whole session. Each
`test_*.py` is parsed, every module it imports is imported here, and the file is listed only if all
of them import; the files left out are named on stderr with the module that failed.
"""

import ast
import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def importable(name: str, seen: dict[str, str | None]) -> str | None:
    """None if `name` imports, else why not."""
    if name not in seen:
        try:
            importlib.import_module(name)
            seen[name] = None
        except ImportError as exc:
            seen[name] = f"{name}: {exc}"
    return seen[name]


def main(folders: list[str]) -> int:
    sys.path[:0] = [str(REPO), str(REPO / "platform")]
    seen: dict[str, str | None] = {}
    for folder in folders:
        for path in sorted((REPO / folder).rglob("test_*.py")):
            problems = [p for p in (importable(n, seen) for n in imported_modules(path)) if p]
            relative = path.relative_to(REPO)
            if problems:
                print(f"left out {relative}: {problems[0]}", file=sys.stderr)
            else:
                print(relative)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["tests/kernels", "tests/engine"]))
