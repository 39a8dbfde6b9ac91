from django.core.management.base import BaseCommand

from metering.parking import usage_batches_replay


class Command(BaseCommand):
    help = "Ingests the usage batches that were parked after a failure (safe to run again: ingest is idempotent)."

    def handle(self, *args, **options):
        replayed, failing = usage_batches_replay()
        self.stdout.write(f"replayed {replayed} parked batches; {failing} still failing")
        if failing:
            raise SystemExit(1)
