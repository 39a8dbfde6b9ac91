"""Uploaded archives are hostile: traversal, links, devices, bombs and oversized or corrupt archives are
refused, and the temporary directory they were unpacked into is gone afterwards (`scratch` checks)."""

import stat
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from adapters import AdapterError, ArchiveLimits, load_adapter
from tests.adapters.builders import (
    distinct_refusal_messages,
    file_source,
    make_tar,
    make_zip,
    refusal,
    tar_file,
    tar_special,
    valid_files,
)


def zipped(*members: tuple[str | zipfile.ZipInfo, bytes]) -> Callable[[Path], Path]:
    return lambda tmp: make_zip(tmp / "upload.zip", list(members))


def tarred(*members: tuple[tarfile.TarInfo, bytes | None]) -> Callable[[Path], Path]:
    return lambda tmp: make_tar(tmp / "upload.tar.gz", list(members))


def zip_link() -> zipfile.ZipInfo:
    info = zipfile.ZipInfo("adapter_model.safetensors")
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


def truncated_zip(tmp: Path) -> Path:
    whole = make_zip(tmp / "whole.zip", list(valid_files().items())).read_bytes()
    (tmp / "upload.zip").write_bytes(whole[:300])
    return tmp / "upload.zip"


# fmt: off
CASES = [
    ("pickle-beside-safetensors-in-zip", zipped(*valid_files().items(), ("optimizer.pt", b"\x80\x04.")), "pickle_file", "optimizer.pt"),
    ("zip-absolute-path", zipped(*valid_files().items(), ("/etc/cron.d/x", b"x")), "archive_unsafe_path", "absolute path"),
    ("zip-dot-dot", zipped(*valid_files().items(), ("a/../../escape.txt", b"x")), "archive_unsafe_path", "'..'"),
    ("zip-backslash-dot-dot", zipped(*valid_files().items(), ("a\\..\\..\\escape.txt", b"x")), "archive_unsafe_path", "climbs out"),
    ("zip-drive-letter", zipped(*valid_files().items(), ("C:\\Windows\\evil.dll", b"x")), "archive_unsafe_path", "'C:\\\\Windows"),
    ("zip-symlink", zipped(("adapter_config.json", b"{}"), (zip_link(), b"/etc/passwd")), "archive_link", "symbolic link"),
    ("zip-duplicate-member", zipped(*valid_files().items(), ("adapter_config.json", b"{}")), "archive_duplicate_member", "twice"),
    ("zip-bomb", zipped(*valid_files().items(), ("README.md", b"\x00" * (3 << 20))), "archive_compression_ratio", "zip bomb"),
    ("zip-truncated", truncated_zip, "archive_corrupt", "damaged"),
    ("tar-symlink", tarred((tar_special("adapter_model.safetensors", tarfile.SYMTYPE, "/etc/passwd"), None)), "archive_link", "is a link"),
    ("tar-hardlink", tarred((tar_special("adapter_config.json", tarfile.LNKTYPE, "/etc/shadow"), None)), "archive_link", "is a link"),
    ("tar-device", tarred((tar_special("dev", tarfile.CHRTYPE), None)), "archive_special_file", "not a regular file"),
    ("tar-fifo", tarred((tar_special("pipe", tarfile.FIFOTYPE), None)), "archive_special_file", "not a regular file"),
    ("tar-dot-dot", tarred((tar_file("../evil"), b"x")), "archive_unsafe_path", "'..'"),
    ("tar-absolute", tarred((tar_file("/tmp/evil"), b"x")), "archive_unsafe_path", "absolute path"),
    ("tar-bomb", tarred(*((tar_file(n), d) for n, d in valid_files().items()), (tar_file("pad"), b"\x00" * (8 << 20))), "archive_compression_ratio", "zip bomb"),
    ("tar-too-many-members", tarred(*((tar_file(f"f{i}.txt"), b"x") for i in range(300))), "archive_too_many_members", "more than 256"),
    ("not-an-archive", file_source("upload.bin.txt", b"hello, world" * 50), "unsupported_source", "not a directory, a .zip or a .tar.gz"),
    ("damaged-zip", file_source("upload.zip", b"hello, world" * 50), "archive_corrupt", "upload.zip is not a readable zip archive"),
    ("two-adapters", zipped(*((f"one/{n}", d) for n, d in valid_files().items()), *((f"two/{n}", d) for n, d in valid_files().items())), "multiple_adapters", "one, two"),
    ("source-missing", lambda tmp: tmp / "nowhere.zip", "source_missing", "does not exist"),
]
# fmt: on


@pytest.mark.parametrize(
    ("build", "code", "fragment"), [pytest.param(*case[1:], id=case[0]) for case in CASES]
)
def test_refused_with_its_own_message(tmp_path, llama_base, build, code, fragment):
    refused = refusal(build, tmp_path, llama_base)
    assert refused.code == code, refused.message
    assert fragment in refused.message


def test_cases_have_distinct_messages(tmp_path, llama_base):
    assert len(CASES) >= 15
    assert len(distinct_refusal_messages(CASES, tmp_path, llama_base)) == len(CASES)


def test_archive_total_size_cap(tmp_path, llama_base):
    source = make_zip(
        tmp_path / "big.zip", [*valid_files().items(), ("notes.txt", b"x" * 300_000)], deflate=False
    )
    with pytest.raises(AdapterError) as refused:
        load_adapter(source, llama_base, limits=ArchiveLimits(max_total_bytes=200_000))
    assert refused.value.code == "archive_too_large"


def test_tar_stream_cap_stops_a_bomb_hidden_in_headers(tmp_path, llama_base):
    pax = tarfile.TarInfo("adapter_config.json")
    pax.pax_headers = {"comment": "x" * 400_000}
    source = make_tar(tmp_path / "pax.tar.gz", [(pax, b"{}")])
    with pytest.raises(AdapterError) as refused:
        load_adapter(
            source,
            llama_base,
            limits=ArchiveLimits(max_members=4, max_total_bytes=100_000, ratio_floor_bytes=1 << 30),
        )
    assert refused.value.code == "archive_too_large"


def test_finder_zip_with_macosx_metadata_loads(tmp_path, llama_base):
    files = valid_files()
    members = [(f"my-adapter/{name}", data) for name, data in files.items()]
    members += [(f"__MACOSX/my-adapter/._{name}", b"\0\5\26\7") for name in files]
    members += [("my-adapter/", b""), ("my-adapter/.DS_Store", b"\0\0\0\1Bud1")]
    adapter = load_adapter(make_zip(tmp_path / "Archive.zip", members), llama_base)
    assert adapter.target_modules == ["q_proj", "v_proj"]


def test_tar_with_root_and_directory_entries_loads(tmp_path, llama_base):
    directory = tarfile.TarInfo("./adapter")
    directory.type = tarfile.DIRTYPE
    members = [(tarfile.TarInfo("."), None), (directory, None)]
    members[0][0].type = tarfile.DIRTYPE
    members += [(tar_file(f"./adapter/{name}"), data) for name, data in valid_files().items()]
    adapter = load_adapter(make_tar(tmp_path / "adapter.tgz", members), llama_base)
    assert adapter.rank == 4


def test_windows_zip_with_backslashes_loads(tmp_path, llama_base):
    members = [(f"my-adapter\\{name}", data) for name, data in valid_files().items()]
    assert load_adapter(make_zip(tmp_path / "windows.zip", members), llama_base).rank == 4
