"""The layout rules of DESIGN.md: platform/ is a source root, and the engine side never imports Django."""

import subprocess
import sys
from pathlib import Path

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


def test_engine_kernels_and_adapters_never_import_django():
    result = _run(_walk_and_check("adapters", "kernels", "engine"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_the_django_guard_catches_a_module_that_imports_django(tmp_path):
    (tmp_path / "leaky").mkdir()
    (tmp_path / "leaky" / "__init__.py").write_text("")
    (tmp_path / "leaky" / "deep.py").write_text("import django.conf\n")
    result = _run(_walk_and_check("leaky"), extra_path=str(tmp_path))
    assert result.returncode != 0
    assert "django" in result.stderr
