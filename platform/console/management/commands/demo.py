"""`python manage.py demo`: migrate, seed, and run the platform on the embedded defaults until Ctrl-C."""

import os
import subprocess
import sys

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Run the demo: migrate, seed a tenant and key, and serve the platform with uvicorn."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)

    def handle(self, *args, host, port, **options):
        call_command("migrate", verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        call_command("seeddemo")
        base = f"http://{host}:{port}"
        self.stdout.write(f"console:        {base}/")
        self.stdout.write(f"management API: {base}/api/v1/  (docs: {base}/api/docs/)")
        self.stdout.write(f"admin:          {base}/admin/")
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "quilt.settings.dev")}
        command = [sys.executable, "-m", "uvicorn", "quilt.asgi:application", "--host", host, "--port", str(port),
                   "--app-dir", str(settings.REPO_ROOT / "platform")]  # fmt: skip
        try:
            subprocess.run(command, env=env, check=False)
        except KeyboardInterrupt:
            pass
