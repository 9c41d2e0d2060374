"""Just enough of CRIU's image format to read the credentials a restore would give each thread.

A ``core-TID.img`` is 8 bytes of magic (the inventory: 4), then entries (a little-endian u32 size, then a protobuf message).
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


def entries(image: bytes, head: int = 8) -> list[bytes]:
    """The messages of an image whose head (magic numbers) is ``head`` bytes long."""
    out, i = [], head
    while i < len(image):
        if i + 4 > len(image):
            raise ValueError("truncated entry size")
        (size,) = struct.unpack_from("<I", image, i)
        if i + 4 + size > len(image):
            raise ValueError("truncated entry")
        out.append(image[i + 4:i + 4 + size])
        i += 4 + size
    return out


#: the heads of a core image (two magic numbers) and of the inventory (its own alone; magic.h)
CORE_HEAD = struct.pack("<II", 0x54564319, 0x55053847)
INVENTORY_HEAD = struct.pack("<I", 0x58313116)
#: InventoryEntry.img_version of the images CRIU >= 1.x writes (CRTOOLS_IMAGES_V1_1); an older
#: version changes how CRIU reads every other image, so it is refused
IMAGES_V1_1 = 2
#: CredsEntry: fields that are plain numbers once (IDs, securebits, no_new_privs), lists of numbers
#: (capability sets and groups, packed or not), and byte strings (LSM labels)
_ONCE = {1, 2, 3, 4, 5, 6, 7, 8, 13, 18}
_LISTS = {9, 10, 11, 12, 14, 19}
_BYTES = {15, 16, 17}


def _packed(data: bytes) -> list[int]:
    values, i = [], 0
    while i < len(data):
        value, i = _varint(data, i)
        values.append(value)
    return values


def _only(found: list[tuple[int, int, int | bytes]], number: int, what: str) -> bytes:
    """The one length-delimited field ``number`` of a message (protobuf would merge several: refused)."""
    matches = [f for f in found if f[0] == number]
    if len(matches) != 1 or matches[0][1] != 2:
        raise ValueError(f"{len(matches)} {what} fields, not exactly one message")
    return matches[0][2]  # type: ignore[return-value]


@dataclass
class Creds:
    #: CredsEntry field number (1-8: uid, gid, euid, egid, suid, sgid, fsuid, fsgid) -> ID
    ids: dict[int, int] = field(default_factory=dict)
    #: capability set -> whether any bit of it is asked for
    capabilities: dict[str, int] = field(default_factory=dict)
    securebits: int = 0


def thread_creds(core_image: bytes) -> Creds:
    """The credentials a ``core-TID.img`` gives its thread, read as strictly as CRIU reads them loosely:
    anything protobuf would merge or CRIU would read otherwise (two messages, an unknown field, a
    different head) raises :class:`ValueError`."""
    if core_image[:8] != CORE_HEAD:
        raise ValueError("not a core image head")
    found = entries(core_image)
    if not found:
        raise ValueError("no entry")
    thread_core = fields(_only(fields(found[0]), 5, "thread_core"))
    creds_fields = fields(_only(thread_core, 10, "creds"))
    creds = Creds()
    seen: set[int] = set()
    for number, kind, value in creds_fields:
        if number in _ONCE:
            if kind != 0 or number in seen:
                raise ValueError(f"creds field {number} twice or of wire type {kind}")
            seen.add(number)
            if number in UIDS:
                creds.ids[number] = int(value)  # type: ignore[arg-type]
            elif number == SECUREBITS:
                creds.securebits = int(value)  # type: ignore[arg-type]
        elif number in _LISTS:
            if kind == 0:
                values = [int(value)]  # type: ignore[arg-type]
            elif kind == 2:
                values = _packed(value)  # type: ignore[arg-type]
            else:
                raise ValueError(f"creds field {number} of wire type {kind}")
            if number in CAP_SETS:
                name = CAP_SETS[number]
                creds.capabilities[name] = creds.capabilities.get(name, 0) | any(values)
        elif number in _BYTES:
            if kind != 2:
                raise ValueError(f"creds field {number} of wire type {kind}")
        else:
            raise ValueError(f"unknown creds field {number}")
    if not set(UIDS) | {SECUREBITS} <= seen:
        raise ValueError("creds without all their IDs or securebits")
    return creds


def inventory_version(inventory_image: bytes) -> int:
    if inventory_image[:4] != INVENTORY_HEAD:
        raise ValueError("not an inventory image head")
    found = entries(inventory_image, head=4)
    versions = [v for n, k, v in fields(found[0]) if n == 1] if found else []
    if len(versions) != 1 or not isinstance(versions[0], int):
        raise ValueError("no single img_version")
    return versions[0]


def why_not(core_image: bytes, uid: int, gid: int) -> str | None:
    """Why restoring this thread would give more than an ordinary process of ``uid`` has, or None."""
    try:
        creds = thread_creds(core_image)
    except (ValueError, IndexError, struct.error) as exc:
        return f"it is not a core image this helper can check ({exc})"
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
