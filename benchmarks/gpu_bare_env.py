"""Make this machine look like the GPU machine to Python: stub packages for what that machine lacks.

    python benchmarks/gpu_bare_env.py DIR      # then: PYTHONPATH=DIR:$PYTHONPATH pytest -p no:django ...

The device machine (see docs/gpu.md) has torch, triton, transformers, peft, pytest, numpy, safetensors,
tokenizers, jinja2, httpx and prometheus-client, but none of the control plane's packages. Each name
below becomes a package whose import raises ImportError, so that a dry run here fails where the GPU
machine would (a test module importing kombu at the top, a conftest importing Django).
"""

import sys
from pathlib import Path

# Import names of packages in requirements/*.txt (or pulled in by them) that the GPU image does not hold.
ABSENT = (
    "amqp", "asgiref", "axes", "billiard", "celery", "channels", "channels_redis", "django", "django_celery_beat",
    "django_htmx", "dotenv", "drf_spectacular", "environ", "factory", "faker", "freezegun", "httptools", "kombu",
    "openai", "playwright", "psycopg", "pydantic", "pytest_django", "redis", "rest_framework",
    "rest_framework_api_key", "schemathesis", "sqlalchemy", "sqlparse", "starlette", "storages", "uvicorn", "vine",
    "watchfiles", "websockets", "whitenoise",
)  # fmt: skip
# pytest plugins that the stubs above would break at start-up (pass each as `-p no:NAME`).
PLUGINS = ("django", "faker", "schemathesis")


def write_stubs(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in ABSENT:
        package = directory / name
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text(
            f"raise ImportError({name!r} + ' is not installed on the GPU machine (simulated by gpu_bare_env.py)')\n"
        )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    write_stubs(Path(sys.argv[1]))
