"""Where fine-tuning keeps bytes: uploaded files in the platform's storage (`fine-tune-files/<uuid>.jsonl`), and
each job's working folder (checkpoints, the trained adapter) on the training machine's disk."""

import shutil
import uuid
from pathlib import Path

from django.conf import settings
from django.core.files.base import ContentFile

from registry.storage import blob_storage

FILES_PREFIX = "fine-tune-files"


def file_store(*, content: bytes) -> str:
    key = f"{FILES_PREFIX}/{uuid.uuid4().hex}.jsonl"
    stored = blob_storage().save(key, ContentFile(content))
    if stored != key:
        raise RuntimeError(f"storage renamed {key!r} to {stored!r}")
    return key


def file_read(*, key: str) -> bytes:
    with blob_storage().open(key, "rb") as handle:
        return handle.read()


def file_remove(*, key: str) -> None:
    blob_storage().delete(key)


def work_dir(*, job_public_id: str) -> Path:
    return Path(settings.QUILT_FINE_TUNING_WORK_DIR or Path(settings.MEDIA_ROOT) / "fine-tuning") / job_public_id


def work_dir_remove(*, job_public_id: str) -> None:
    shutil.rmtree(work_dir(job_public_id=job_public_id), ignore_errors=True)
