"""The checks an upload passes before it is stored and a version number is spent, while the uploader waits.

They are the `adapters` package's own structural checks, run on the request: the archive is a real .zip or
.tar.gz and unpacks safely, no pickle anywhere, one adapter_config.json that PEFT would accept, and a
safetensors file whose header is sound and whose modules the base model's family has (a Phi-3 adapter may name
the fused or the split projections). The shapes, the values and the canonical form stay in the worker's
validation. The upload's content digest (SHA-256 over its files) lets an identical
re-upload be recognised before it becomes a new version.
"""

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from django.core.files import File

import adapters
from adapters.archive import unpacked
from adapters.layout import PICKLE_SUFFIXES, find_adapter_files
from adapters.loader import check_modules_against_base
from adapters.peft_config import LoraSettings
from adapters.safetensors_check import check_safetensors
from registry.errors import RegistryRefusal
from registry.storage import ARCHIVE_SUFFIXES, safe_upload_name

_CHUNK = 1 << 20


@dataclass(frozen=True)
class CheckedUpload:
    sha256: str  # of the single file, or of the sorted (name, file digest) pairs of several
    rank: int


def _refusal(error: adapters.AdapterError) -> RegistryRefusal:
    text = error.message.strip()
    first_word = text.split(" ", 1)[0]
    if first_word.isalpha() and first_word.islower():  # a sentence; not a file or field name ("adapter.zip", "lora_alpha")
        text = text[:1].upper() + text[1:]
    if not text.endswith("."):
        text += "."
    return RegistryRefusal(text, code=error.code)


def _copy(upload: File, target: Path) -> str:
    digest = hashlib.sha256()
    upload.seek(0)
    with open(target, "wb") as handle:
        for chunk in upload.chunks(_CHUNK):
            digest.update(chunk)
            handle.write(chunk)
    upload.seek(0)
    return digest.hexdigest()


def _content_digest(named: dict[str, str]) -> str:
    if len(named) == 1:
        return next(iter(named.values()))
    combined = hashlib.sha256()
    for name in sorted(named):
        combined.update(f"{name}\0{named[name]}\n".encode())
    return combined.hexdigest()


def upload_check(*, files: list[File], base_config: dict) -> CheckedUpload:
    """Refuses (RegistryRefusal with the package's code) what the worker would certainly refuse."""
    names = [safe_upload_name(upload.name) for upload in files]
    pickles = [name for name in names if name.lower().endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise RegistryRefusal(
            f"{', '.join(pickles)} is a pickle file: loading it can run code, so Quilt refuses it. Save the adapter "
            "with safetensors (save_pretrained's default) and upload adapter_config.json with "
            "adapter_model.safetensors, or their folder zipped.",
            code="pickle_file",
        )  # fmt: skip
    if len(set(names)) != len(names):
        raise RegistryRefusal("Two of the chosen files have the same name; choose each file once.", code="duplicate_file")
    workdir = Path(tempfile.mkdtemp(prefix="quilt-upload-check-"))
    try:
        digests = {name: _copy(upload, workdir / name) for name, upload in zip(names, files, strict=True)}
        single_archive = len(names) == 1 and names[0].lower().endswith(ARCHIVE_SUFFIXES)
        source = workdir / names[0] if single_archive else workdir
        try:
            with unpacked(source, limits=adapters.ArchiveLimits()) as root:
                found = find_adapter_files(root)
                lora = LoraSettings.from_json(found.config.read_bytes())
                entries = check_safetensors(found.weights)
                check_modules_against_base(lora, entries, base_config)
        except adapters.AdapterError as error:
            raise _refusal(error) from None
    finally:
        shutil.rmtree(workdir)
    return CheckedUpload(sha256=_content_digest(digests), rank=lora.r)
