"""Make this machine look like the GPU machine to Python: stub packages for what that machine lacks.

    python benchmarks/gpu_bare_env.py DIR      # then: PYTHONPATH=DIR:$PYTHONPATH pytest -p no:django ...

The GPU machine's image holds the distributions in IMAGE (read off such a machine on 2026-11-17:
/work/.library/device/KINDS.md) and nothing else. Every top-level module that a distribution installed here
provides, where that distribution is not in IMAGE, is hidden (DIR/sitecustomize.py: importlib finds it only on
the path entries in front of DIR, so find_spec gives None and an import raises ModuleNotFoundError): a dry
run here then fails where the GPU machine would (the engine importing llguidance or celery, a test importing
jsonschema or kombu), unless the wheels the suite carries (benchmarks/gpu_wheels.py) are put in front of
DIR on the path, as they are there.
"""

import importlib.metadata
import re
import sys
from pathlib import Path

IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def top_level_modules(dist: importlib.metadata.Distribution) -> set[str]:
    """The importable top-level names a distribution installs (from its file list)."""
    names = set()
    for file in dist.files or []:
        first = file.parts[0]
        if len(file.parts) == 1 and file.suffix in (".py", ".so", ".pyd"):
            names.add(first.split(".")[0])
        elif len(file.parts) > 1 and not first.endswith((".dist-info", ".egg-info", ".data")) and first not in (
                "..", "__pycache__", "bin"):
            names.add(first)
    return {n for n in names if n.isidentifier()}


def with_requirements(names: frozenset[str], dists: dict[str, importlib.metadata.Distribution]) -> set[str]:
    """`names` and, transitively, what their distributions installed here require (extras aside): an image
    package's own needs are on the image too (huggingface_hub's httpx2, anyio's sniffio, whatever versions
    this machine holds)."""
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for requirement in (dists[name].requires or []) if name in dists else []:
            if "extra ==" not in requirement:
                todo.append(normalized(re.split(r"[\[=<>!~ ;(]", requirement.strip())[0]))
    return found


def absent_modules() -> list[str]:
    """Top-level modules installed here by distributions the image lacks (and by none it has)."""
    dists = {normalized(d.metadata["Name"]): d for d in importlib.metadata.distributions() if d.metadata["Name"]}
    on_image = with_requirements(IMAGE, dists)
    present, absent = set(), set()
    for name, dist in dists.items():
        (present if name in on_image else absent).update(top_level_modules(dist))
    return sorted(absent - present - set(sys.stdlib_module_names) - {"engine", "kernels", "adapters", "tests"})


SITECUSTOMIZE = '''"""Written by benchmarks/gpu_bare_env.py: the modules of distributions the GPU image lacks are not there.

A top-level module of ABSENT is looked for only on the path entries in front of this folder (the wheels the suite
carries); elsewhere importlib.util.find_spec gives None and an import raises ModuleNotFoundError, as on the image
(torch, for one, probes optional modules such as dill with find_spec and imports them when found)."""

import importlib.machinery
import os
import sys

ABSENT = frozenset(%r)
HERE = os.path.dirname(os.path.abspath(__file__))


class FrontOfThisFolder:
    """The path finder, which finds a module of ABSENT only in front of this folder on sys.path."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if path is None and name in ABSENT:
            entries = [os.path.abspath(entry or os.curdir) for entry in sys.path]
            path = sys.path[: entries.index(HERE)] if HERE in entries else []
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    @staticmethod
    def invalidate_caches():
        importlib.machinery.PathFinder.invalidate_caches()

    @staticmethod
    def find_distributions(*args, **kwargs):  # importlib.metadata's look-ups, as the path finder answers them
        return importlib.machinery.PathFinder.find_distributions(*args, **kwargs)


sys.meta_path[:] = [FrontOfThisFolder if finder is importlib.machinery.PathFinder else finder
                    for finder in sys.meta_path]
'''


def write_stubs(directory: Path) -> list[str]:
    """directory/sitecustomize.py, which hides the modules the image lacks from an interpreter whose path has
    the directory (PYTHONPATH); their names."""
    directory.mkdir(parents=True, exist_ok=True)
    names = absent_modules()
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE % (sorted(names),))
    return names


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    stubbed = write_stubs(Path(sys.argv[1]))
    print(f"gpu_bare_env: {len(stubbed)} modules of distributions the GPU image lacks now raise ImportError",
          file=sys.stderr)
