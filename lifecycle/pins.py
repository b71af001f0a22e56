"""Pins ("promoted" checkpoints), stored in the bucket itself.

Every node, the lifecycle CronJob and any operator see the same pins because
they live next to the data: one zero-byte directory-marker object per pin,

    <store prefix>/.ckptfs/pins/<checkpoint path>/

(``.ckptfs/pins/run1/step_1000/`` pins ``run1/step_1000``).  Directory-marker
keys (ending in ``/``) are used so that a pin on ``run1`` and a pin on
``run1/step_1000`` can coexist in a ``file://`` store, where a key cannot be
both an object and a prefix.  The object's user metadata records who pinned it
and when (informational only).

Keys under ``.ckptfs/`` (and ``.ckptfs-*``, e.g. the drain's write probe) are
ckptfs' own bookkeeping: :func:`is_reserved_key` tells the lifecycle code to
leave them out of the listing it plans over.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import socket
from collections.abc import Iterable

RESERVED_DIR = ".ckptfs/"
PIN_PREFIX = RESERVED_DIR + "pins/"


class PinError(ValueError):
    """A path that cannot be pinned (empty, '..', reserved)."""


def is_reserved_key(key: str) -> bool:
    """ckptfs bookkeeping objects: never part of a checkpoint, never planned over."""
    first = key.split("/", 1)[0]
    return first == ".ckptfs" or first.startswith(".ckptfs-")


def normalize_pin_path(path: str) -> str:
    """A checkpoint path relative to the store prefix: no leading/trailing '/',
    no empty, '.' or '..' components, not inside ``.ckptfs/``."""
    if not isinstance(path, str):
        raise PinError(f"pin path must be a string, got {type(path).__name__}")
    rel = path.strip("/")
    if not rel:
        raise PinError("refusing to pin the whole bucket prefix; name a checkpoint or a directory of checkpoints")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise PinError(f"pin path {path!r} has an empty, '.' or '..' component")
    if is_reserved_key(rel):
        raise PinError(f"pin path {path!r} is inside ckptfs' reserved {RESERVED_DIR} directory")
    return rel


def pin_key(path: str) -> str:
    """The marker object of a pin on ``path``."""
    return PIN_PREFIX + normalize_pin_path(path) + "/"


def pins_from_keys(keys: Iterable[str]) -> list[str]:
    """The pinned paths among listing keys (keys relative to the store prefix)."""
    pins = set()
    for key in keys:
        if key.startswith(PIN_PREFIX) and key.endswith("/"):
            rel = key[len(PIN_PREFIX) : -1].strip("/")
            if rel:
                pins.add(rel)
    return sorted(pins)


async def read_pins(store) -> list[str]:
    """Every pinned path of the store (one LIST of ``.ckptfs/pins/``)."""
    result = await store.list(PIN_PREFIX)
    return pins_from_keys(o.key for o in result.objects)


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in a container
        user = "unknown"
    host = socket.gethostname() or "unknown"
    return "".join(c if 0x20 <= ord(c) < 0x7F else "?" for c in f"{user}@{host}")[:200]


async def add_pin(store, path: str) -> bool:
    """Pin ``path``; False if it was already pinned (nothing written)."""
    key = pin_key(path)
    if await store.head(key) is not None:
        return False
    now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    await store.put_object(key, b"", {"ckptfs-pinned-by": _who(), "ckptfs-pinned-at": now})
    return True


async def remove_pin(store, path: str) -> bool:
    """Unpin ``path``; False if it was not pinned."""
    key = pin_key(path)
    if await store.head(key) is None:
        return False
    await store.delete(key)
    return True


__all__ = [
    "PIN_PREFIX",
    "RESERVED_DIR",
    "PinError",
    "add_pin",
    "is_reserved_key",
    "normalize_pin_path",
    "pin_key",
    "pins_from_keys",
    "read_pins",
    "remove_pin",
]
