"""Files a tenant uploads for fine-tuning, jobs that train on them, and what a job reports (events, checkpoints).

Objects are addressed by OpenAI-style public ids (`file-…`, `ftjob-…`), never by database keys.
"""

import secrets
from decimal import Decimal

from django.db import models

from apikeys.models import ApiKey
from billing.models import Invoice
from registry.models import AdapterVersion, BaseModel
from tenancy.models import Tenant


def file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def job_id() -> str:
    return f"ftjob-{secrets.token_hex(12)}"


def event_id() -> str:
    return f"ftevent-{secrets.token_hex(12)}"


def checkpoint_id() -> str:
    return f"ftckpt-{secrets.token_hex(12)}"


class TrainingFile(models.Model):
    """A JSONL file uploaded with purpose "fine-tune"; its bytes live in storage under `storage_key`."""

    public_id = models.CharField(max_length=40, unique=True, default=file_id)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="training_files")
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=32, default="fine-tune")
    bytes = models.BigIntegerField()
    storage_key = models.CharField(max_length=300)
    method = models.CharField(max_length=16, help_text="The format its examples are in: supervised or dpo.")
    examples = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    deleted_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.public_id


class FineTuningJob(models.Model):
    class Status(models.TextChoices):
        VALIDATING_FILES = "validating_files"
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        CANCELLED = "cancelled"

    ACTIVE = (Status.VALIDATING_FILES, Status.QUEUED, Status.RUNNING)

    public_id = models.CharField(max_length=40, unique=True, default=job_id)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="fine_tuning_jobs")
    created_by_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="+")
    training_file = models.ForeignKey(TrainingFile, on_delete=models.PROTECT, related_name="+")
    validation_file = models.ForeignKey(
        TrainingFile, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    method = models.CharField(max_length=16)
    hyperparameters = models.JSONField(help_text="Resolved: n_epochs, batch_size, learning_rate_multiplier, ...")
    suffix = models.CharField(max_length=64)
    seed = models.BigIntegerField()
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED, db_index=True)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.TextField(blank=True)
    error_param = models.CharField(max_length=64, blank=True)
    total_steps = models.PositiveIntegerField(default=0)
    steps_done = models.PositiveIntegerField(default=0)
    trained_tokens = models.BigIntegerField(null=True, blank=True)
    fine_tuned_model = models.CharField(max_length=100, blank=True)
    adapter_version = models.ForeignKey(
        AdapterVersion, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    attempts = models.PositiveIntegerField(default=0, help_text="Times a trainer claimed the job.")
    run_token = models.CharField(max_length=32, blank=True, help_text="The claim of the trainer now running it.")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    price_training_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, default=Decimal(0))
    invoice = models.ForeignKey(Invoice, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["tenant", "status"], name="ftjob_tenant_status")]

    def __str__(self) -> str:
        return self.public_id

    @property
    def is_active(self) -> bool:
        return self.status in self.ACTIVE


class JobEvent(models.Model):
    class Level(models.TextChoices):
        INFO = "info"
        WARN = "warn"
        ERROR = "error"

    class Kind(models.TextChoices):
        MESSAGE = "message"
        METRICS = "metrics"

    public_id = models.CharField(max_length=40, unique=True, default=event_id)
    job = models.ForeignKey(FineTuningJob, on_delete=models.CASCADE, related_name="events")
    level = models.CharField(max_length=8, choices=Level.choices, default=Level.INFO)
    kind = models.CharField(max_length=8, choices=Kind.choices, default=Kind.MESSAGE)
    message = models.TextField()
    data = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.message


class JobCheckpoint(models.Model):
    public_id = models.CharField(max_length=40, unique=True, default=checkpoint_id)
    job = models.ForeignKey(FineTuningJob, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.PositiveIntegerField()
    metrics = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        constraints = [models.UniqueConstraint(fields=["job", "step"], name="ftcheckpoint_job_step_unique")]

    def __str__(self) -> str:
        return f"{self.job.public_id} step {self.step}"
