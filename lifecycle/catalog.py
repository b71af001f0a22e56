"""Group a bucket listing into checkpoint series.

A key belongs to the checkpoint named by its OUTERMOST path component that
matches a checkpoint pattern (the first pattern in config order wins when
several match the same name).  If that component is the key's last one the
checkpoint is a single file; if any key lies below it, it is a directory and
holds every key below it.  Checkpoints sharing a parent path and pattern form a
series; retention rules apply to each series on its own.  Keys that belong to
no checkpoint are "unmanaged" and never touched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Literal

from ckptfs.fsmeta.settings import is_marker_name

from .patterns import compile_step_pattern, match_step
from .rules import LifecycleRules
from .storage_classes import normalize_storage_class

DIRECTORY: Literal["directory"] = "directory"
FILE: Literal["file"] = "file"
MIXED = "mixed"

# An executor that changes storage classes by copying objects in place resets
# their LastModified.  It can record the original time in this object tag (ISO
# 8601 or Unix seconds) so that ages, and therefore expiry, keep counting from
# the original upload.
MTIME_TAG = "ckptfs-mtime"


@dataclass(frozen=True)
class ListedObject:
    """One object of a bucket listing; ``key`` is relative to the bucket prefix.

    ``etag`` is not used by the planner; it is carried through to the plan so
    an executor can make its copies conditional on the object being unchanged.
    """

    key: str
    size: int
    last_modified: datetime
    storage_class: str = "STANDARD"
    tags: Mapping[str, str] | None = None
    etag: str | None = None

    @classmethod
    def coerce(cls, obj: object) -> ListedObject:
        """Accept a ListedObject; any object with ``key``, ``size``,
        ``last_modified`` and optionally ``storage_class``/``tags``/``etag``
        attributes (e.g. drain.store.ObjectSummary); a mapping with those keys;
        or a boto3 ListObjectsV2 entry (Key/Size/LastModified/StorageClass/ETag)."""
        if isinstance(obj, ListedObject):
            info = obj
        elif isinstance(obj, Mapping):
            if "Key" in obj:
                fields = (obj["Key"], obj["Size"], obj["LastModified"], obj.get("StorageClass"), obj.get("Tags"))
                info = cls(*fields, etag=obj.get("ETag"))
            else:
                fields = (obj["key"], obj["size"], obj["last_modified"], obj.get("storage_class"), obj.get("tags"))
                info = cls(*fields, etag=obj.get("etag"))
        elif all(hasattr(obj, name) for name in ("key", "size", "last_modified")):
            info = cls(
                obj.key,  # type: ignore[attr-defined]
                obj.size,  # type: ignore[attr-defined]
                obj.last_modified,  # type: ignore[attr-defined]
                getattr(obj, "storage_class", None),
                getattr(obj, "tags", None),
                getattr(obj, "etag", None),
            )
        else:
            raise TypeError(f"cannot read a listing entry from {type(obj).__name__}")
        if info.last_modified.tzinfo is None:
            raise ValueError(f"{info.key}: last_modified must be timezone-aware")
        if info.storage_class != normalize_storage_class(info.storage_class):
            info = replace(info, storage_class=normalize_storage_class(info.storage_class))
        return info


@dataclass(frozen=True)
class Checkpoint:
    series: str  # display name of its series, e.g. "run1/step_{step}"
    path: str  # relative to the bucket prefix, no trailing '/'
    step: int
    kind: Literal["directory", "file"]
    objects: tuple[ListedObject, ...]  # sorted by key
    marker_keys: tuple[str, ...]  # keys of the completeness markers found
    complete: bool
    last_modified: datetime  # newest object's (tag-corrected) modification time

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def storage_class(self) -> str:
        classes = {o.storage_class for o in self.objects}
        return classes.pop() if len(classes) == 1 else MIXED

    @property
    def order_key(self) -> tuple[int, datetime, str]:
        """Series order: by step; ties (step_100 vs step_0100) by time, then path."""
        return (self.step, self.last_modified, self.path)


@dataclass(frozen=True)
class Series:
    parent: str  # "" for checkpoints at the top of the bucket prefix
    pattern: str
    checkpoints: tuple[Checkpoint, ...]  # oldest first (see Checkpoint.order_key)

    @property
    def name(self) -> str:
        return series_name(self.parent, self.pattern)

    @property
    def complete(self) -> tuple[Checkpoint, ...]:
        return tuple(c for c in self.checkpoints if c.complete)


@dataclass(frozen=True)
class Catalog:
    series: tuple[Series, ...]  # sorted by name
    unmanaged: tuple[ListedObject, ...]
    warnings: tuple[str, ...]

    @property
    def checkpoints(self) -> tuple[Checkpoint, ...]:
        return tuple(c for s in self.series for c in s.checkpoints)


def series_name(parent: str, pattern: str) -> str:
    return f"{parent}/{pattern}" if parent else pattern


def is_internal_key(key: str) -> bool:
    first = key.split("/", 1)[0]
    return first == ".ckptfs" or first.startswith(".ckptfs-")


def _covers(directory: str, objects: list[ListedObject]) -> bool:
    # (a directory placeholder object ``path/`` holds nothing)
    return all(o.key.startswith(directory + "/") for o in objects if not o.key.endswith("/"))


def build_catalog(listing: Iterable[object], rules: LifecycleRules) -> Catalog:
    patterns = [(text, compile_step_pattern(text)) for text in rules.checkpoints]
    # ckptfs' own keys (pins under .ckptfs/, file-store internals) are never checkpoints.
    objects = [o for o in (ListedObject.coerce(o) for o in listing) if not is_internal_key(o.key)]
    warnings: list[str] = []

    seen: set[str] = set()
    for obj in objects:
        if obj.key in seen:
            raise ValueError(f"duplicate key in listing: {obj.key!r}")
        seen.add(obj.key)

    # path -> (parent, pattern, step, members)
    found: dict[str, tuple[str, str, int, list[ListedObject]]] = {}
    unmanaged: list[ListedObject] = []
    for obj in objects:
        owner = _owning_checkpoint(obj.key, patterns)
        if owner is None:
            unmanaged.append(obj)
            continue
        path, parent, pattern, step = owner
        found.setdefault(path, (parent, pattern, step, []))[3].append(obj)

    by_series: dict[tuple[str, str], list[Checkpoint]] = {}
    bad_tags: list[str] = []
    for path, (parent, pattern, step, members) in found.items():
        members.sort(key=lambda o: o.key)
        inside = [o for o in members if o.key.startswith(path + "/")]
        kind = DIRECTORY if inside else FILE
        if kind == DIRECTORY:
            marker_keys = tuple(o.key for o in inside if is_marker_name(o.key.rsplit("/", 1)[-1], rules.markers))
            # The drain uploads a marker after every file below the marker's own directory
            # (drain/schedule.py), so a marker vouches only for that directory: the
            # checkpoint is complete when one marker's directory holds all of its objects.
            complete = any(_covers(m.rsplit("/", 1)[0], inside) for m in marker_keys)
        else:
            marker_keys = ()
            complete = True  # a single-file checkpoint is complete once it is listed
        mtimes = []
        for o in members:
            mtime, ok = effective_mtime(o)
            mtimes.append(mtime)
            if not ok:
                bad_tags.append(o.key)
        by_series.setdefault((parent, pattern), []).append(
            Checkpoint(
                series=series_name(parent, pattern),
                path=path,
                step=step,
                kind=kind,
                objects=tuple(members),
                marker_keys=marker_keys,
                complete=complete,
                last_modified=max(mtimes),
            )
        )
    if bad_tags:
        warnings.append(
            f"ignored unparsable {MTIME_TAG} tag on {len(bad_tags)} object(s), e.g. {bad_tags[0]!r}; "
            "used LastModified instead"
        )

    series = [
        Series(parent, pattern, tuple(sorted(cps, key=lambda c: c.order_key)))
        for (parent, pattern), cps in by_series.items()
    ]
    series.sort(key=lambda s: (s.parent, s.pattern))
    unmanaged.sort(key=lambda o: o.key)
    return Catalog(tuple(series), tuple(unmanaged), tuple(warnings))


def _owning_checkpoint(key: str, patterns: list[tuple[str, re.Pattern[str]]]) -> tuple[str, str, str, int] | None:
    components = key.split("/")
    for depth, name in enumerate(components):
        for text, regex in patterns:
            step = match_step(regex, name)
            if step is not None:
                parent = "/".join(components[:depth])
                path = "/".join(components[: depth + 1])
                return path, parent, text, step
    return None


def effective_mtime(obj: ListedObject) -> tuple[datetime, bool]:
    """The object's modification time, honouring MTIME_TAG; (time, tag_was_ok)."""
    raw = (obj.tags or {}).get(MTIME_TAG)
    if raw is None:
        return obj.last_modified, True
    try:
        try:
            parsed = datetime.fromtimestamp(float(raw), tz=timezone.utc)
        except ValueError:
            parsed = datetime.fromisoformat(str(raw))
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=timezone.utc)
    except (ValueError, OverflowError, OSError):
        return obj.last_modified, False
    return parsed, True


__all__ = [
    "Catalog",
    "Checkpoint",
    "DIRECTORY",
    "FILE",
    "MIXED",
    "MTIME_TAG",
    "ListedObject",
    "Series",
    "build_catalog",
    "effective_mtime",
    "series_name",
]
