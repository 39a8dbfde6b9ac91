"""Adapter blobs through Django's storage API: raw uploads, and canonical forms stored once per content digest.

Keys: `adapters/<digest>/<file>` holds what `LoadedAdapter.save` writes (the sidecar is written last and
marks the blob complete); `adapter-uploads/<uuid>/<file>` holds an upload until it is validated.
With the filesystem storage the engines read `adapter_store_root()` directly. With a storage that signs URLs (S3)
engines are handed signed GET URLs of the files they read (`canonical_urls`) and download them themselves: no
shared volume. Any other remote storage is mirrored on demand into QUILT_ADAPTER_CACHE_DIR, which is then the root.
"""

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.core.files import File
from django.core.files.base import ContentFile
from django.core.files.storage import FileSystemStorage, Storage, storages

import adapters
from engine.contract import ADAPTER_FILES

CANONICAL_PREFIX = "adapters"
UPLOAD_PREFIX = "adapter-uploads"
COMPLETE_MARKER = "quilt_adapter.json"
ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz")


def blob_storage() -> Storage:
    return storages["default"]


def _is_local(storage: Storage) -> bool:
    return isinstance(storage, FileSystemStorage)


def adapter_store_root() -> Path:
    storage = blob_storage()
    if _is_local(storage):
        return Path(storage.path(CANONICAL_PREFIX))
    return Path(settings.QUILT_ADAPTER_CACHE_DIR)


def canonical_key(digest: str) -> str:
    return f"{CANONICAL_PREFIX}/{digest}"


def _signs_urls(storage: Storage) -> bool:
    if _is_local(storage):
        return False
    from storages.backends.s3 import S3Storage  # boto3 with it: imported only where the storage is remote

    return isinstance(storage, S3Storage) and storage.querystring_auth


def canonical_urls(*, digest: str) -> dict[str, str] | None:
    """Signed GET URLs of the canonical files an engine downloads (ADAPTER_FILES), each valid for
    QUILT_ADAPTER_URL_SECONDS, where the storage signs them (S3); None where engines read a folder instead."""
    storage = blob_storage()
    if not _signs_urls(storage):
        return None
    key = canonical_key(digest)
    return {name: storage.url(f"{key}/{name}", expire=settings.QUILT_ADAPTER_URL_SECONDS) for name in ADAPTER_FILES}


def _save(storage: Storage, name: str, content: File) -> None:
    if storage.exists(name) and storage.get_available_name(name) != name:
        storage.delete(name)  # a storage that won't overwrite (the filesystem's default); same bytes go back
    stored = storage.save(name, content)
    if stored != name:
        raise RuntimeError(f"storage renamed {name!r} to {stored!r}; adapter keys must be exact")


def _files_under(storage: Storage, prefix: str) -> list[str]:
    try:
        _, files = storage.listdir(prefix)
    except FileNotFoundError:
        return []
    return [f"{prefix}/{name}" for name in files]


def _delete_prefix(storage: Storage, prefix: str) -> None:
    for name in _files_under(storage, prefix):
        storage.delete(name)
    if _is_local(storage) and Path(storage.path(prefix)).is_dir():
        storage.delete(prefix)


def _children(storage: Storage, prefix: str) -> list[str]:
    try:
        directories, _ = storage.listdir(prefix)
    except FileNotFoundError:
        return []
    return directories


def _newest_change(storage: Storage, prefix: str) -> datetime | None:
    times = [storage.get_modified_time(name) for name in _files_under(storage, prefix)]
    return max(times) if times else None


def safe_upload_name(name: str) -> str:
    base = PurePosixPath(name.replace("\\", "/")).name.strip()
    cleaned = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in base).lstrip(".")
    return cleaned[:120] or "upload"


def upload_store(*, files: list[File]) -> str:
    """Copies the uploaded files (already streamed to temporary files) into storage; returns their prefix."""
    storage = blob_storage()
    key = f"{UPLOAD_PREFIX}/{uuid.uuid4().hex}"
    try:
        for upload in files:
            upload.seek(0)
            _save(storage, f"{key}/{safe_upload_name(upload.name)}", upload)
    except BaseException:
        _delete_prefix(storage, key)
        raise
    return key


def upload_delete(*, key: str) -> None:
    if key:
        _delete_prefix(blob_storage(), key)


@contextmanager
def upload_source(*, key: str) -> Iterator[Path]:
    """A local path `adapters.load_adapter` can read: the single archive uploaded, else the folder of files."""
    storage = blob_storage()
    names = _files_under(storage, key) if key.startswith(f"{UPLOAD_PREFIX}/") else []
    if not names:
        raise FileNotFoundError(f"upload {key} is gone from storage")
    if _is_local(storage):
        yield _pick_source(Path(storage.path(key)), names)
        return
    workdir = Path(tempfile.mkdtemp(prefix="quilt-upload-"))
    try:
        for name in names:
            with storage.open(name, "rb") as remote, open(workdir / PurePosixPath(name).name, "wb") as local:
                shutil.copyfileobj(remote, local, 1 << 20)
        yield _pick_source(workdir, names)
    finally:
        shutil.rmtree(workdir)


def _pick_source(folder: Path, names: list[str]) -> Path:
    if len(names) == 1 and names[0].lower().endswith(ARCHIVE_SUFFIXES):
        return folder / PurePosixPath(names[0]).name
    return folder


def canonical_exists(*, digest: str) -> bool:
    return blob_storage().exists(f"{canonical_key(digest)}/{COMPLETE_MARKER}")


def _touch(storage: Storage, name: str) -> None:
    """Marks a blob as just used, so GC's grace period starts again (engines may be reading it: never removed)."""
    if _is_local(storage):
        os.utime(storage.path(name))
        return
    with storage.open(name, "rb") as handle:
        content = handle.read()
    _save(storage, name, ContentFile(content, name=PurePosixPath(name).name))


def canonical_put(*, adapter: "adapters.LoadedAdapter") -> str:
    """Stores the canonical form once per digest (a blob already complete is shared); returns its key."""
    storage = blob_storage()
    key = canonical_key(adapter.digest)
    marker = f"{key}/{COMPLETE_MARKER}"
    if storage.exists(marker):
        _touch(storage, marker)
        return key
    workdir = Path(tempfile.mkdtemp(prefix="quilt-canonical-"))
    try:
        adapter.save(workdir)
        names = sorted(path.name for path in workdir.iterdir())
        for name in [n for n in names if n != COMPLETE_MARKER] + [COMPLETE_MARKER]:
            with open(workdir / name, "rb") as handle:
                _save(storage, f"{key}/{name}", File(handle, name=name))
    finally:
        shutil.rmtree(workdir)
    return key


def canonical_local_dir(*, digest: str) -> Path:
    """The canonical folder on this machine (mirrored from a remote storage when needed)."""
    storage = blob_storage()
    key = canonical_key(digest)
    if _is_local(storage):
        return Path(storage.path(key))
    root = adapter_store_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / digest
    if not (target / COMPLETE_MARKER).exists():
        partial = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=root))
        for name in _files_under(storage, key):
            with storage.open(name, "rb") as remote, open(partial / PurePosixPath(name).name, "wb") as local:
                shutil.copyfileobj(remote, local, 1 << 20)
        try:
            partial.rename(target)
        except OSError:  # another process mirrored it first: theirs is the same content
            shutil.rmtree(partial)
    return target


def canonical_delete(*, digest: str) -> None:
    _delete_prefix(blob_storage(), canonical_key(digest))


def stored_canonical_digests() -> dict[str, datetime | None]:
    """Every digest with a blob in storage, complete or not, with its newest file's modification time."""
    storage = blob_storage()
    return {
        digest: _newest_change(storage, canonical_key(digest)) for digest in _children(storage, CANONICAL_PREFIX)
    }


def stored_uploads() -> dict[str, datetime | None]:
    storage = blob_storage()
    return {
        f"{UPLOAD_PREFIX}/{name}": _newest_change(storage, f"{UPLOAD_PREFIX}/{name}")
        for name in _children(storage, UPLOAD_PREFIX)
    }
