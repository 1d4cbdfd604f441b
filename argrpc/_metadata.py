"""Metadata conversion between grpc's Python form and the engine's form.

Shared by the channel and the server facade. grpc validates metadata in its C core and
answers an illegal key or value with INTERNAL "Invalid metadata"; the engine does not
validate, so this module does it with the same rules (validate_metadata.cc):

* keys: non-empty, only ``a-z 0-9 - _ .`` (so no upper case and no ``:`` pseudo-headers);
* non-binary values: printable ASCII ``0x20..0x7e``;
* ``-bin`` values: any bytes, but a ``str`` there is a ``TypeError`` (as in grpc).
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any, Iterable, Sequence

__all__ = ["InvalidMetadataError", "Metadatum", "from_core", "to_core"]

# grpc returns metadata as tuples of `_Metadatum(key, value)` namedtuples; users may use
# either the tuple or the attribute form, so mirror it exactly.
_Metadatum = namedtuple("_Metadatum", ("key", "value"))
Metadatum = _Metadatum

_LEGAL_KEY_BYTES = b"abcdefghijklmnopqrstuvwxyz0123456789-_."
_LEGAL_VALUE_BYTES = bytes(range(0x20, 0x7F))


class InvalidMetadataError(ValueError):
    """A metadata key or value grpc would reject; calls answer INTERNAL "Invalid metadata"."""


def _key_str(key: Any) -> str:
    name: str
    if isinstance(key, str):
        name = key
        try:
            raw = key.encode("ascii")
        except UnicodeEncodeError:
            raise InvalidMetadataError(f"Metadata key {key!r} is invalid: Illegal header key") from None
    elif isinstance(key, (bytes, bytearray)):
        raw = bytes(key)
        name = raw.decode("latin-1")
    else:
        raise TypeError(f"metadata key must be str or bytes, got {type(key)!r}")
    # translate(None, legal) deletes every legal byte: anything left is illegal.
    if not raw or raw.translate(None, _LEGAL_KEY_BYTES):
        raise InvalidMetadataError(f"Metadata key {name!r} is invalid: Illegal header key")
    return name


def _value_bytes(key: str, value: Any) -> bytes:
    if key.endswith("-bin"):
        if isinstance(value, bytes):
            return value
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        raise TypeError(f'Binary metadata key="{key}" expected bytes, got {type(value)!r}')
    if isinstance(value, str):
        try:
            raw = value.encode("ascii")
        except UnicodeEncodeError:
            raise InvalidMetadataError(
                f"Metadata value for key {key} is invalid: Illegal header value") from None
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
    else:
        raise TypeError(f"metadata value for key {key!r} must be str or bytes, got {type(value)!r}")
    if raw.translate(None, _LEGAL_VALUE_BYTES):
        raise InvalidMetadataError(f"Metadata value for key {key} is invalid: Illegal header value")
    return raw


def to_core(metadata: Iterable[Sequence[Any]] | None) -> list[tuple[str, bytes]]:
    """grpc-style metadata (pairs of key and str/bytes value) -> engine form.

    Raises InvalidMetadataError for what grpc's core rejects and TypeError for what grpc's
    Python layer rejects (e.g. a str value for a ``-bin`` key).
    """
    if not metadata:
        return []
    out: list[tuple[str, bytes]] = []
    for item in metadata:
        key, value = item  # grpc also accepts any 2-sequence (including _Metadatum)
        k = _key_str(key)
        out.append((k, _value_bytes(k, value)))
    return out


def _decode(value: Any) -> str:
    if isinstance(value, str):
        return value
    raw = bytes(value)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")  # what grpc._common.decode falls back to


# A connection's calls mostly carry the same metadata (the user-agent, a token), and a
# server converts it for every call it looks a generic handler up for: the converted
# tuples are immutable, so equal engine lists share one. Bounded by entries and by the
# entry count of one list; cleared whole when full (no LRU bookkeeping on the hot path).
_CONVERTED: dict[Any, tuple[Metadatum, ...]] = {}
_CONVERTED_MAX = 64
_CONVERTED_MAX_ENTRIES = 8


def from_core(metadata: Iterable[Sequence[Any]] | None) -> tuple[Metadatum, ...]:
    """Engine form -> grpc form: tuple of (key, value); only ``-bin`` values stay bytes."""
    if not metadata:
        return ()
    try:
        key = tuple(metadata)
        hit = _CONVERTED.get(key)
    except TypeError:  # unhashable entries (lists): convert without the cache
        return _convert(metadata)
    if hit is not None:
        return hit
    out = _convert(key)
    if len(key) <= _CONVERTED_MAX_ENTRIES:
        if len(_CONVERTED) >= _CONVERTED_MAX:
            _CONVERTED.clear()
        _CONVERTED[key] = out
    return out


def _convert(metadata: Iterable[Sequence[Any]]) -> tuple[Metadatum, ...]:
    out = []
    for key, value in metadata:
        if isinstance(key, (bytes, bytearray)):
            key = bytes(key).decode("latin-1")
        if key.endswith("-bin"):
            out.append(Metadatum(key, value if isinstance(value, bytes) else bytes(value)))
        else:
            out.append(Metadatum(key, _decode(value)))
    return tuple(out)
