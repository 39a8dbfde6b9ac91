"""The contract's version, carried by every message as `v`, and the error a message of another version gets."""

import msgspec

VERSION = 1  # what this side speaks; a message of another version is refused, naming both


class VersionOnly(msgspec.Struct):
    v: int = VERSION


class WrongVersion(ValueError):
    """A peer speaks another version of the contract."""

    def __init__(self, message: str, version: object):
        super().__init__(f"{message} version {version!r} is not the version this side speaks ({VERSION})")
        self.version = version


def check_version(message: str, v: int) -> None:
    """For a message's `__post_init__`: refuses another version, whichever side made the message."""
    if v != VERSION:
        raise WrongVersion(message, v)


def version_of(data: object) -> object:
    """The `v` a peer sent in `data` (decoded JSON), VERSION if it sent none: read when a message fails to decode,
    so that a message of another version is refused for its version rather than for a field it spells otherwise."""
    if isinstance(data, dict):
        return data.get("v", VERSION)
    try:
        return msgspec.json.decode(data, type=VersionOnly).v if isinstance(data, bytes | str) else VERSION
    except msgspec.DecodeError:
        return VERSION
