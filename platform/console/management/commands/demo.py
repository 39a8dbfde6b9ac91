"""`python manage.py demo`: the whole platform on one machine, on the embedded defaults, until Ctrl-C.

Builds (or reuses) the demo model (with progress and a time estimate), migrates and seeds, then runs a CPU engine
on the demo model, a Celery worker and beat, a training worker (the fine-tuning queue, one torch thread), and the
gateway (uvicorn). Once they are all up it prints, last,
the log-ins, the API key (the same one on every run: see seeddemo) and examples that stream through an adapter.

The embedded default has no Redis, so the worker's live pushes (adapter validation) reach the browser through
the web server's relay (QUILT_LIVE_RELAY_URL). Debug pages are off: the demo shows the console's own 404/500.
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from console.management.commands.seeddemo import DEMO_BASE_MODEL, credentials, seed_demo

ENGINE_NAME = "demo-cpu"
PREFILL_ENGINE_NAME = "demo-prefill"  # --disaggregate: the prefill engine, on the engine port + 1
DEMO_MIN_UNCACHED_TOKENS = "32"  # --disaggregate: the demo model's context is 256 tokens, under the default 256
DEMO_PROMPT = "the cat sees a red ball"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
WORKER_BANNER_END = ".> "  # the banner's queue lines come last: the worker is up once they are out
STARTUP_SECONDS = 120


def examples(*, base: str, key: str, adapters: list[str], model: str = DEMO_BASE_MODEL, images: bool = False) -> str:
    """How to call the demo: curl and the openai package; for a vision-language base, an image as well."""
    adapter = adapters[0] if adapters else model
    models = ", ".join(repr(name) for name in [model, *adapters])
    return f"""
Stream an answer through the '{adapter}' adapter with curl:

  curl -N {base}/v1/chat/completions \\
    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{adapter}", "messages": [{{"role": "user", "content": "{DEMO_PROMPT}"}}], "stream": true}}'

or with the openai package, the same prompt through the base model and each adapter:

  .venv/bin/python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{key}")
for model in ({models}):
    stream = client.chat.completions.create(
        model=model, messages=[{{"role": "user", "content": "{DEMO_PROMPT}"}}], max_tokens=32, temperature=0, stream=True
    )
    print(f"{{model:>12}}:", "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
EOF
""" + (image_example(base=base, key=key, model=model) if images else "")


def image_example(*, base: str, key: str, model: str) -> str:
    return f"""
and, this base reading images, a picture drawn with Pillow sent as a data URL:

  .venv/bin/python - <<'EOF'
import base64, io
from openai import OpenAI
from PIL import Image, ImageDraw
picture = Image.new("RGB", (224, 160), "white")
ImageDraw.Draw(picture).ellipse((40, 30, 180, 130), fill="red")
buffer = io.BytesIO()
picture.save(buffer, format="PNG")
url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
client = OpenAI(base_url="{base}/v1", api_key="{key}")
answer = client.chat.completions.create(model="{model}", max_tokens=64, messages=[{{"role": "user", "content": [
    {{"type": "image_url", "image_url": {{"url": url}}}}, {{"type": "text", "text": "What is in this picture?"}}]}}])
print(answer.choices[0].message.content)
print(answer.usage)  # the image's tokens are prompt tokens
EOF
"""


def chosen_model(model: Path | None, model_name: str | None) -> tuple[Path | None, str, bool]:
    """The checkpoint the demo serves (None: the demo model, built), the base model's name and whether it reads
    images (a vision-language checkpoint: its config.json has a vision_config)."""
    if model is None:
        return None, DEMO_BASE_MODEL, False
    model = model.expanduser().resolve()
    config = model / "config.json"
    if not config.is_file():
        raise CommandError(f"--model {model}: no config.json there (a Hugging Face checkpoint folder is needed)")
    return model, model_name or model.name, "vision_config" in json.loads(config.read_text())


def broker_tables_create(url: str) -> None:
    """kombu's SQLAlchemy transport (the embedded broker) creates its tables on first use; the engine, two workers
    and beat starting at once each tried, and all but one logged 'table kombu_message already exists'. Made here,
    once, before any of them starts, there is nothing left to race for. Other brokers need nothing."""
    if not url.startswith("sqla+"):
        return
    from kombu import Connection

    with Connection(url) as connection:
        _ = connection.default_channel.session  # opening its session creates the tables


def _require_free(host: str, port: int, flag: str) -> None:
    """Refuses a port something already listens on before anything starts: a second demo would otherwise point the
    running one's engine registration at itself and fail only at the gateway's bind, among the workers' banners."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise CommandError(f"port {port} on {host} is already in use ({error.strerror}): another `make demo` "
                               f"still running? Stop it, or choose another port: make demo {flag}=...") from error


class Command(BaseCommand):
    help = "Run the demo: demo model, migrate, seed, then engine + worker + trainer + beat + gateway until Ctrl-C."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000, help="The console and APIs (make demo PORT=...).")
        parser.add_argument("--engine-port", type=int, default=8100, help="The CPU engine (make demo ENGINE_PORT=...).")
        parser.add_argument("--engine-args", default="",
                            help='More `python -m engine` flags, e.g. "--quantization int8" (make demo ENGINE_ARGS=...).')
        parser.add_argument("--model", type=Path, default=None,
                            help="Serve this checkpoint folder instead of the demo model, e.g. a Qwen2.5-VL or "
                                 "Qwen3-VL checkpoint for images (make demo MODEL=...; docs/models.md).")
        parser.add_argument("--model-name", default=None, help="Its base model's name (default: the folder's name).")
        parser.add_argument("--disaggregate", action="store_true",
                            help="Two engines: a prefill engine (on the engine port + 1) and a decode engine; prompts "
                                 "whose uncached part is 32 tokens or more go through the prefill one "
                                 "(make demo DISAGG=1, docs/kv-tiers.md).")

    def handle(self, *args, host, port, engine_port, engine_args, disaggregate, model, model_name, **options):
        _require_free(host, port, "PORT")
        _require_free("127.0.0.1", engine_port, "ENGINE_PORT")
        if disaggregate:
            _require_free("127.0.0.1", engine_port + 1, "ENGINE_PORT")
        root = settings.REPO_ROOT
        model_dir, base_name, images = chosen_model(model, model_name)
        if model_dir is None:
            model_dir = settings.VAR_DIR / "demo-model"
            self.stdout.write("building (or reusing) the demo model ...")
            subprocess.run([sys.executable, "-u", "-m", "engine.demo", "--out", str(model_dir)], cwd=root, check=True)
        call_command("migrate", verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        broker_tables_create(settings.CELERY_BROKER_URL)
        if model is None:
            seed = seed_demo(model_dir=model_dir, log=lambda line: None)
        else:  # the tenant and its key; the checkpoint registered (or re-read) under its own name, no adapters
            seed = seed_demo(model_dir=None, log=lambda line: None)
            call_command("registerbasemodel", base_name, str(model_dir))
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "quilt.settings.dev"),
            "PYTHONPATH": os.pathsep.join([str(root), str(root / "platform")]),
            "PYTHONUNBUFFERED": "1",
            "QUILT_ENGINE_TOKEN": settings.QUILT_ENGINE_TOKEN,
            "DEBUG": os.environ.get("DEBUG", "false"),
        }
        if host not in LOCAL_HOSTS:
            env.setdefault("ALLOWED_HOSTS", "*")
        if disaggregate:
            env.setdefault("QUILT_PREFILL_HOP_MIN_UNCACHED_TOKENS", DEMO_MIN_UNCACHED_TOKENS)
        background = dict(env)
        if not settings.REDIS_URL:
            background["QUILT_LIVE_RELAY_URL"] = f"http://127.0.0.1:{port}/internal/live-relay/"
        engine_url = f"http://127.0.0.1:{engine_port}"
        celery = [sys.executable, "-m", "celery", "--workdir", str(root / "platform"), "-A", "quilt"]
        commands = {
            "engine": [
                sys.executable, "-m", "engine", "--model", str(model_dir), "--port", str(engine_port),
                "--adapter-store", str(settings.MEDIA_ROOT / "adapters"), "--served-model-name", base_name,
                "--broker-url", settings.CELERY_BROKER_URL, "--usage-queue", settings.CELERY_TASK_DEFAULT_QUEUE,
                "--log-level", "warning",
            ],
            "worker": [*celery, "worker", "--pool", "solo", "--loglevel", "WARNING", "-Q", settings.CELERY_TASK_DEFAULT_QUEUE],
            "trainer": [*celery, "worker", "--pool", "solo", "--loglevel", "WARNING", "-Q", settings.QUILT_TRAINING_QUEUE,
                        "-n", "trainer@%h"],
            "beat": [*celery, "beat", "--loglevel", "WARNING"],
            "gateway": [
                sys.executable, "-m", "uvicorn", "gateway.asgi:application", "--http", "httptools", "--loop", "uvloop",
                "--host", host, "--port", str(port),
                "--app-dir", str(root / "platform"), "--no-access-log", "--lifespan", "off", "--timeout-keep-alive", "75",
            ],
        }  # fmt: skip
        commands["engine"] += shlex.split(engine_args)
        engines = {"engine": (ENGINE_NAME, engine_url)}
        if disaggregate:  # the same engine twice, each with its role (engine/config.py ROLES)
            prefill_url = f"http://127.0.0.1:{engine_port + 1}"
            commands["prefill"] = [*commands["engine"], "--role", "prefill", "--port", str(engine_port + 1)]
            commands["engine"] += ["--role", "decode"]
            engines["prefill"] = (PREFILL_ENGINE_NAME, prefill_url)
        processes: dict[str, subprocess.Popen] = {}
        worker_up = threading.Event()
        try:
            for process_name in engines:
                processes[process_name] = subprocess.Popen(commands[process_name], cwd=root, env=env)
            for process_name, (name, url) in engines.items():
                self._wait_for_engine(url, processes[process_name])
                call_command("registerengine", name, url, "--gpu-price-per-hour", "0.50")
            for name in ("worker", "trainer", "beat"):
                own_env = {**background, "QUILT_FINE_TUNING_THREADS": "1"} if name == "trainer" else background
                processes[name] = subprocess.Popen(commands[name], cwd=root, env=own_env, text=True,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
                threading.Thread(target=_forward, args=(processes[name], worker_up if name == "worker" else None),
                                 daemon=True).start()  # fmt: skip
            processes["gateway"] = subprocess.Popen(commands["gateway"], cwd=root, env=env)
            base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
            self._wait_until_up(base, processes, worker_up)
            self.stdout.write("\n" + "=" * 72)
            self.stdout.write(credentials(seed))
            self.stdout.write(f"\nconsole:        {base}/  (log in as the tenant owner above)")
            self.stdout.write(f"management API: {base}/api/v1/  (docs: {base}/api/docs/)")
            self.stdout.write(f"inference API:  {base}/v1/  (OpenAI-compatible)")
            if disaggregate:
                self.stdout.write(f"disaggregated:  {PREFILL_ENGINE_NAME} ({engines['prefill'][1]}) prefills prompts "
                                  f"of {env['QUILT_PREFILL_HOP_MIN_UNCACHED_TOKENS']}+ uncached tokens, {ENGINE_NAME} "
                                  f"({engine_url}) decodes (docs/kv-tiers.md)")
            self.stdout.write(examples(base=base, key=seed.api_key, adapters=seed.adapters, model=base_name,
                                       images=images))
            self.stdout.write("=" * 72 + "\nCtrl-C stops everything.")
            stopping = threading.Event()  # Ctrl-C reaches every process of the group at once
            signal.signal(signal.SIGINT, lambda *_: stopping.set())
            signal.signal(signal.SIGTERM, lambda *_: stopping.set())
            while not stopping.wait(0.5):
                stopped = [name for name, process in processes.items() if process.poll() is not None]
                if stopped and not stopping.wait(2.0):
                    raise CommandError(f"the demo's {', '.join(stopped)} stopped; shutting the rest down")
            self.stdout.write("\nstopping ...")
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.send_signal(signal.SIGINT)
            for process in processes.values():
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()

    def _wait_until_up(self, base: str, processes: dict[str, subprocess.Popen], worker_up: threading.Event) -> None:
        """The gateway answers and the worker has printed its banner, so nothing scrolls the credentials away."""
        self.stdout.write("starting the worker, beat and gateway ...")
        deadline = time.monotonic() + STARTUP_SECONDS
        gateway_up = False
        while time.monotonic() < deadline and not (gateway_up and worker_up.is_set()):
            stopped = [name for name, process in processes.items() if process.poll() is not None]
            if stopped:
                raise CommandError(f"the demo's {', '.join(stopped)} stopped while starting")
            if not gateway_up:
                try:
                    gateway_up = httpx.get(f"{base}/login/", timeout=1.0).status_code == 200
                except httpx.HTTPError:
                    pass
            time.sleep(0.3)
        time.sleep(0.5)  # the worker's last banner lines

    def _wait_for_engine(self, url: str, process: subprocess.Popen) -> None:
        self.stdout.write("starting the engine on the demo model ...")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise CommandError(f"the engine exited with {process.returncode}")
            try:
                headers = {"Authorization": f"Bearer {settings.QUILT_ENGINE_TOKEN}"}
                if httpx.get(f"{url}/v1/health", headers=headers, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise CommandError("the engine did not answer within 5 minutes")


def _forward(process: subprocess.Popen, banner_done: threading.Event | None) -> None:
    """Passes a background process's output through; marks its start-up banner as finished."""
    for line in process.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if banner_done is not None and line.lstrip().startswith(WORKER_BANNER_END.strip() + " "):
            banner_done.set()
    if banner_done is not None:
        banner_done.set()
