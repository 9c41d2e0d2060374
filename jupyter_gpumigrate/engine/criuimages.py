"""Just enough of CRIU's image format to read the credentials a restore would give each thread.

A ``core-TID.img`` is 8 bytes of magic, then entries (a little-endian u32 size, then a protobuf message).
Its first entry is a CoreEntry, whose field 5 is the ThreadCoreEntry, whose field 10 is the CredsEntry
(CRIU's images/core.proto and images/creds.proto): uid, gid, euid, egid, suid, sgid, fsuid, fsgid
(fields 1-8), then the capability sets as repeated 32-bit words: inheritable 9, permitted 10,
effective 11, bounding 12, ambient 19; securebits is field 13.

Written here rather than with CRIU's own pycriu, which needs CRIU's generated protobuf modules and is
not published as a package: the node helper checks only these few fields, of bytes it has copied.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

#: CredsEntry field numbers
UIDS = range(1, 9)
CAP_SETS = {9: "inheritable", 10: "permitted", 11: "effective", 19: "ambient"}
SECUREBITS = 13


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def fields(message: bytes) -> list[tuple[int, int, int | bytes]]:
    """One level of protobuf wire format: (field number, wire type, value)."""
    out: list[tuple[int, int, int | bytes]] = []
    i = 0
    while i < len(message):
        key, i = _varint(message, i)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, i = _varint(message, i)
            out.append((number, kind, value))
        elif kind == 2:
            size, i = _varint(message, i)
            if i + size > len(message):
                raise ValueError("truncated field")
            out.append((number, kind, message[i:i + size]))
            i += size
        elif kind in (1, 5):
            width = 8 if kind == 1 else 4
            out.append((number, kind, message[i:i + width]))
            i += width
        else:
            raise ValueError(f"wire type {kind}")
    return out


def entries(image: bytes) -> list[bytes]:
    out, i = [], 8
    while i < len(image):
        if i + 4 > len(image):
            raise ValueError("truncated entry size")
        (size,) = struct.unpack_from("<I", image, i)
        if i + 4 + size > len(image):
            raise ValueError("truncated entry")
        out.append(image[i + 4:i + 4 + size])
        i += 4 + size
    return out


@dataclass
class Creds:
    #: CredsEntry field number (1-8: uid, gid, euid, egid, suid, sgid, fsuid, fsgid) -> ID
    ids: dict[int, int] = field(default_factory=dict)
    capabilities: dict[str, int] = field(default_factory=dict)
    securebits: int = 0


def thread_creds(core_image: bytes) -> Creds | None:
    """The credentials a ``core-TID.img`` asks for, or None if it holds none."""
    found = entries(core_image)
    if not found:
        return None
    for number, kind, value in fields(found[0]):
        if number != 5 or kind != 2:
            continue
        for sub_number, sub_kind, sub_value in fields(value):  # type: ignore[arg-type]
            if sub_number != 10 or sub_kind != 2:
                continue
            creds = Creds()
            words: dict[int, int] = {}
            for n, k, v in fields(sub_value):  # type: ignore[arg-type]
                if k != 0:
                    continue
                if n in UIDS:
                    creds.ids[n] = int(v)  # type: ignore[arg-type]
                elif n in CAP_SETS:
                    word = words.get(n, 0)
                    words[n] = word + 1
                    name = CAP_SETS[n]
                    creds.capabilities[name] = creds.capabilities.get(name, 0) | int(v) << (32 * word)  # type: ignore[arg-type]
                elif n == SECUREBITS:
                    creds.securebits = int(v)  # type: ignore[arg-type]
            return creds
    return None


def why_not(core_image: bytes, uid: int, gid: int) -> str | None:
    """Why restoring this thread would give more than an ordinary process of ``uid`` has, or None."""
    try:
        creds = thread_creds(core_image)
    except (ValueError, IndexError, struct.error) as exc:
        return f"it is not a CRIU core image ({exc})"
    if creds is None:
        return "it holds no credentials"
    uids = {creds.ids.get(n) for n in (1, 3, 5, 7)}
    gids = {creds.ids.get(n) for n in (2, 4, 6, 8)}
    if uids != {uid} or gids != {gid}:
        return f"it asks for user IDs {sorted(map(str, uids))} and group IDs {sorted(map(str, gids))}, not yours ({uid}, {gid})"
    held = [name for name, bits in creds.capabilities.items() if bits]
    if held:
        return f"it asks for {', '.join(held)} capabilities"
    if creds.securebits:
        return f"it asks for securebits {creds.securebits:#x}"
    return None
