"""Fetch, here, the wheels the GPU image lacks for the engine and its GPU tests; the suite installs them there.

    python benchmarks/gpu_wheels.py .whl            # cp312 manylinux wheels, for the GPU machine (no network there)
    python benchmarks/gpu_wheels.py --local .whl-local   # the same pins for this Python: the dry run's stand-in
    python benchmarks/gpu_wheels.py --check-with /path/to/python3.12 .whl   # a bare 3.12 venv takes them (below)

What is fetched: requirements/engine.txt and the GPU tests' own needs (TEST_NEEDS, pinned in requirements/dev.txt),
with every dependency pip resolves for the target, less each distribution the image already has
(gpu_bare_env.IMAGE: torch, triton, numpy, safetensors, tokenizers, jinja2, httpx, ... are never carried, so
nothing the image's torch stack depends on is shadowed). The folder is emptied first and holds one version of
each distribution; `.whl/` must be ignored (`echo /.whl/ >> .git/info/exclude`, docs/gpu.md) and carried. On the
GPU machine `bash benchmarks/gpu_suite.sh` installs it with `pip install --no-index --no-deps --target`.

NIXL: the image's CUDA is 13 (its nvidia-*-cu13 distributions), so the GPU machine gets nixl-cu13 of the pinned
version where requirements/engine.txt pins nixl-cu12 (FOR_THE_IMAGE). Its wheel (59 MB) is more than a device call
carries beside the others, so it is rewritten without what the engine never loads (TRIMMED: the expert-parallel
package and the C headers), about 29 MB; its RECORD lists what is left.

--check-with PYTHON (a CPython 3.12 here, e.g. pyenv's) proves the cp312 set on its own: a fresh venv gets only
the image's distributions that the wheels require (from PyPI: stand-ins for what the image has), then the wheels by
the suite's own command, then every top-level module the wheels provide must import.
"""

import argparse
import email
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from gpu_bare_env import IMAGE, normalized

REPO = Path(__file__).resolve().parents[1]
TEST_NEEDS = ("jsonschema",)  # imported by tests/engine (test_structured.py), pinned in requirements/dev.txt
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64")
MAX_BYTES = 48 << 20  # the device tool carries 64 MiB with the working tree
FOR_THE_IMAGE = {"nixl-cu12": "nixl-cu13"}  # a pin here -> the distribution the GPU image's CUDA takes
TRIMMED = {"nixl-cu12": ("nixl_ep_cu12/", "nixl_cu12-"), "nixl-cu13": ("nixl_ep_cu13/", "nixl_cu13-")}  # left out:
# the expert-parallel package, and under the .data folder the C headers


def trim(wheel: Path, prefixes: tuple[str, str]) -> None:
    """Rewrite the wheel without the package under prefixes[0] and the headers in its .data folder (prefixes[1]),
    and without their lines in its RECORD."""
    trimmed = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as out:
        for item in source.infolist():
            if item.filename.startswith(prefixes[0]) or (item.filename.startswith(prefixes[1])
                                                          and ".data/headers/" in item.filename):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(prefixes[0])
                               and not (line.startswith(prefixes[1]) and ".data/headers/" in line)).encode()
            out.writestr(item, data)
    trimmed.replace(wheel)


def pins(path: Path) -> dict[str, str]:
    """normalized name -> the requirement line, for every pinned line of a requirements file (not its -r)."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            found[normalized(re.split(r"[\[=<>!~ ]", line)[0])] = line
    return found


def wanted(*, local: bool = False) -> list[str]:
    engine = pins(REPO / "requirements/engine.txt")
    dev = pins(REPO / "requirements/dev.txt")
    lines = [line.replace(name, FOR_THE_IMAGE[name], 1) if name in FOR_THE_IMAGE and not local else line
             for name, line in engine.items() if name not in IMAGE]
    return lines + [dev[name] for name in TEST_NEEDS]


def distribution(wheel: Path) -> str:
    return normalized(wheel.name.split("-")[0])


def download(dest: Path, *, local: bool) -> list[Path]:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    lines = wanted(local=local)
    alone = [line for line in lines if any(line.startswith(name) for name in TRIMMED)]  # nixl: its torch is the image's
    for some, more in (([line for line in lines if line not in alone], []), (alone, ["--no-deps"])):
        if not some:
            continue
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                   "--only-binary=:all:", *more, "--dest", str(dest), *some]
        if not local:
            command[5:5] = ["--python-version", "3.12", "--implementation", "cp"]
            for platform in PLATFORMS:
                command[5:5] = ["--platform", platform]
        subprocess.run(command, check=True)
    kept = []
    for wheel in sorted(dest.glob("*.whl")):
        if distribution(wheel) in IMAGE:
            wheel.unlink()  # the image has it: carrying another version could shadow what torch was built with
        else:
            if distribution(wheel) in TRIMMED:
                trim(wheel, TRIMMED[distribution(wheel)])
            kept.append(wheel)
    names = [distribution(w) for w in kept]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        sys.exit(f"two versions of {duplicates}: the --no-deps install there would refuse them")
    total = sum(w.stat().st_size for w in kept)
    if total > MAX_BYTES:
        sys.exit(f"{total / 2**20:.1f} MiB of wheels: more than the {MAX_BYTES >> 20} MiB the device call can carry")
    return kept


def check_with(python: str, wheels: list[Path], work: Path) -> None:
    """A fresh venv of `python` with the image's distributions the wheels need, then the wheels, then imports."""
    if work.exists():
        shutil.rmtree(work)
    subprocess.run([python, "-m", "venv", str(work / "venv")], check=True)
    venv_python = str(work / "venv/bin/python")
    needs, modules = set(), set()
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            message = email.message_from_bytes(archive.read(meta))
            for requirement in message.get_all("Requires-Dist") or []:
                if "extra ==" not in requirement:
                    name = normalized(re.split(r"[\[=<>!~ ;(]", requirement.strip())[0])
                    if name in IMAGE:
                        needs.add(requirement.split(";")[0].strip())
            for name in archive.namelist():
                first = name.split("/")[0]
                if not first.endswith((".dist-info", ".data")) and (first.isidentifier() or name.endswith(".py")):
                    modules.add(first.removesuffix(".py").split(".")[0])
    if needs:
        subprocess.run([venv_python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *sorted(needs)],
                       check=True)
    subprocess.run([venv_python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(work / "site"),
                    *map(str, wheels)], check=True)  # the suite's own command
    names = sorted(m for m in modules if m.isidentifier() and not m.startswith("_"))
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint(sys.version)"
    done = subprocess.run([venv_python, "-c", code, *names], env={"PYTHONPATH": str(work / "site")},
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"--check-with: an import failed:\n{done.stderr}")
    print(f"--check-with: Python {done.stdout.split()[0]}, a bare venv + {len(needs)} of the image's distributions "
          f"({', '.join(sorted(needs))}) + the wheels: {len(names)} modules import: {' '.join(names)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path, help="the folder to fill (emptied first)")
    parser.add_argument("--local", action="store_true", help="wheels for this Python and platform (the dry run)")
    parser.add_argument("--check-with", metavar="PYTHON", help="check the wheels in DEST in a bare venv of PYTHON")
    args = parser.parse_args()
    if args.check_with:
        check_with(args.check_with, sorted(args.dest.glob("*.whl")), Path(tempfile.mkdtemp(prefix="quilt-wheels-")))
        return
    kept = download(args.dest, local=args.local)
    total = sum(w.stat().st_size for w in kept)
    print(f"{len(kept)} wheels, {total / 2**20:.1f} MiB in {args.dest}: " + " ".join(w.name for w in kept))


if __name__ == "__main__":
    main()
