"""Unpack an uploaded .zip / .tar / .tar.gz into a fresh temporary directory, treating it as hostile.

Refused: absolute paths, `..`, backslashes, links, devices and other special files, duplicate
names, too many members, too many bytes in total, and compression ratios that only a bomb has.
Files are written by us (never by zipfile/tarfile's extract), each created exclusively, and the
temporary directory is removed whatever happens.
"""

import gzip
import re
import shutil
import stat
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from adapters.errors import AdapterError

_CHUNK = 1 << 20


@dataclass(frozen=True)
class ArchiveLimits:
    max_members: int = 256
    max_total_bytes: int = 8 << 30
    max_ratio: float = 200.0
    ratio_floor_bytes: int = 1 << 20  # small members may compress as well as they like


@contextmanager
def unpacked(source: Path, *, limits: ArchiveLimits) -> Iterator[Path]:
    """Yield a directory holding the source's files: the source itself if it is one, else a temporary copy."""
    if source.is_dir():
        yield source
        return
    kind = _archive_kind(source)
    workdir = Path(tempfile.mkdtemp(prefix="quilt-adapter-"))
    try:
        if kind == "zip":
            _extract_zip(source, workdir, limits)
        else:
            _extract_tar(source, workdir, limits, gzipped=kind == "tar.gz")
        yield workdir
    finally:
        shutil.rmtree(workdir)


_ARCHIVE_SUFFIXES = ((".zip", "zip"), (".tar.gz", "tar.gz"), (".tgz", "tar.gz"), (".tar", "tar"))


def _archive_kind(source: Path) -> str:
    if not source.exists():
        raise AdapterError("source_missing", f"{source.name} does not exist")
    with open(source, "rb") as handle:
        head = handle.read(512)
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    if head[257:262] == b"ustar":
        return "tar"
    if source.suffix in (".safetensors", ".json"):
        raise AdapterError(
            "unsupported_source",
            f"{source.name} alone is not an adapter; upload the folder holding adapter_config.json and "
            "adapter_model.safetensors, zipped",
        )
    named = next((kind for suffix, kind in _ARCHIVE_SUFFIXES if source.name.lower().endswith(suffix)), None)
    if named is not None:  # named as an archive, but isn't one
        raise AdapterError(
            "archive_corrupt",
            f"{source.name} is not a readable {named} archive (damaged, or another kind of file renamed); upload the "
            "folder PEFT's save_pretrained wrote, zipped",
        )
    raise AdapterError(
        "unsupported_source",
        f"{source.name} is not a directory, a .zip or a .tar.gz; upload the folder PEFT's save_pretrained wrote, zipped",
    )


class _Tally:
    """Counts members and bytes across an archive and refuses as soon as a limit is crossed."""

    def __init__(self, limits: ArchiveLimits, archive_bytes: int):
        self.limits = limits
        self.archive_bytes = max(archive_bytes, 1)
        self.members = 0
        self.total = 0
        self.names: set[str] = set()

    def member(self, name: str) -> tuple[str, ...]:
        self.members += 1
        if self.members > self.limits.max_members:
            raise AdapterError(
                "archive_too_many_members", f"the archive has more than {self.limits.max_members} entries"
            )
        parts = _safe_parts(name)
        key = "/".join(parts)
        if key in self.names:
            raise AdapterError("archive_duplicate_member", f"the archive holds {name!r} twice")
        self.names.add(key)
        return parts

    def expect(self, declared: int) -> None:
        """Refuse before writing a member whose declared size would cross the cap."""
        if self.total + declared > self.limits.max_total_bytes:
            raise self._too_large()

    def add_bytes(self, count: int) -> None:
        self.total += count
        if self.total > self.limits.max_total_bytes:
            raise self._too_large()

    def _too_large(self) -> AdapterError:
        return AdapterError(
            "archive_too_large",
            f"the archive unpacks to more than {self.limits.max_total_bytes} bytes, the limit",
        )

    def check_ratio(self, uncompressed: int, compressed: int, what: str) -> None:
        if uncompressed > self.limits.ratio_floor_bytes and uncompressed > self.limits.max_ratio * max(
            compressed, 1
        ):
            raise AdapterError(
                "archive_compression_ratio",
                f"{what} compresses {uncompressed // max(compressed, 1)}:1, beyond the {self.limits.max_ratio:g}:1 "
                "that real adapter weights reach; refusing a likely zip bomb",
            )


def _safe_parts(name: str) -> tuple[str, ...]:
    if "\x00" in name:
        raise AdapterError("archive_unsafe_path", f"archive member {name!r} has a NUL byte in its name")
    path = name.replace("\\", "/")  # zips made on Windows may separate with backslashes
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise AdapterError("archive_unsafe_path", f"archive member {name!r} has an absolute path")
    parts = tuple(part for part in path.split("/") if part not in ("", "."))
    if ".." in parts:
        raise AdapterError(
            "archive_unsafe_path", f"archive member {name!r} climbs out of the archive with '..'"
        )
    return parts


def _write_member(
    workdir: Path, parts: tuple[str, ...], stream: IO[bytes], tally: _Tally, declared: int
) -> None:
    target = workdir.joinpath(*parts)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        written = 0
        with open(target, "xb") as out:
            while chunk := stream.read(_CHUNK):
                written += len(chunk)
                if written > declared:
                    raise AdapterError(
                        "archive_corrupt", f"archive member {'/'.join(parts)} is longer than it declares"
                    )
                tally.add_bytes(len(chunk))
                out.write(chunk)
    except (FileExistsError, NotADirectoryError):
        raise AdapterError(
            "archive_duplicate_member", f"archive member {'/'.join(parts)} collides with another entry"
        ) from None


def _extract_zip(source: Path, workdir: Path, limits: ArchiveLimits) -> None:
    tally = _Tally(limits, source.stat().st_size)
    try:
        with zipfile.ZipFile(source) as archive:
            infos = archive.infolist()
            if len(infos) > limits.max_members:
                raise AdapterError(
                    "archive_too_many_members", f"the archive has more than {limits.max_members} entries"
                )
            for info in infos:
                parts = tally.member(info.filename)
                mode = info.external_attr >> 16
                kind = stat.S_IFMT(mode)
                if stat.S_ISLNK(mode):
                    raise AdapterError("archive_link", f"archive member {info.filename!r} is a symbolic link")
                if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                    raise AdapterError(
                        "archive_special_file", f"archive member {info.filename!r} is not a regular file"
                    )
                if info.is_dir() or not parts:
                    continue
                if info.flag_bits & 0x1:
                    raise AdapterError("archive_corrupt", f"archive member {info.filename!r} is encrypted")
                tally.check_ratio(info.file_size, info.compress_size, f"archive member {info.filename!r}")
                tally.expect(info.file_size)
                with archive.open(info) as stream:
                    _write_member(workdir, parts, stream, tally, info.file_size)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as exc:
        raise AdapterError("archive_corrupt", f"the zip archive is damaged or unreadable ({exc})") from None


class _CappedReader:
    """A read-only stream over the decompressed tar bytes that stops a bomb before it is inflated."""

    def __init__(self, inner: IO[bytes], tally: _Tally, cap: int):
        self.inner = inner
        self.tally = tally
        self.cap = cap
        self.consumed = 0

    def read(self, size: int = -1) -> bytes:
        chunk = self.inner.read(size if size >= 0 else _CHUNK)
        self.consumed += len(chunk)
        if self.consumed > self.cap:
            raise AdapterError(
                "archive_too_large", f"the archive unpacks to more than {self.cap} bytes, the limit"
            )
        self.tally.check_ratio(self.consumed, self.tally.archive_bytes, "the archive")
        return chunk


def _extract_tar(source: Path, workdir: Path, limits: ArchiveLimits, *, gzipped: bool) -> None:
    tally = _Tally(limits, source.stat().st_size)
    # headers and padding take at most a few blocks per member on top of the data
    cap = limits.max_total_bytes + 4096 * (limits.max_members + 2)
    try:
        with open(source, "rb") as raw:
            inner: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw
            stream = _CappedReader(inner, tally, cap)
            with tarfile.open(fileobj=stream, mode="r|") as archive:
                for member in archive:
                    parts = tally.member(member.name)
                    if member.issym() or member.islnk():
                        raise AdapterError("archive_link", f"archive member {member.name!r} is a link")
                    if member.isdir() or not parts:
                        continue
                    if not member.isfile():
                        raise AdapterError(
                            "archive_special_file", f"archive member {member.name!r} is not a regular file"
                        )
                    tally.expect(member.size)
                    _write_member(workdir, parts, archive.extractfile(member), tally, member.size)
    except (tarfile.TarError, zlib.error, EOFError, gzip.BadGzipFile) as exc:
        raise AdapterError("archive_corrupt", f"the tar archive is damaged or unreadable ({exc})") from None
