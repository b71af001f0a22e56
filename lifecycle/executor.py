"""Carry a lifecycle Plan out against the object store (``ckptfs lifecycle apply``).

The planner (``lifecycle.planner``) is pure; this module does the I/O around
it, under trio, with the ``ckptfs.drain.store.ObjectStore`` interface:

1. **Inputs** (:func:`gather_inputs`): one listing of the store (keys relative
   to its prefix) without ckptfs' own ``.ckptfs/`` objects; the pins found in
   it (``.ckptfs/pins/``, see :mod:`ckptfs.lifecycle.pins`); the tags of every object
   not in STANDARD (to read ``ckptfs-mtime``, see below); and the keys still
   pending in a local cache directory (:func:`read_local_pending`).
2. **Re-check**: right before executing, pins and local pending keys are read
   again and the plan is recomputed on the same listing; a checkpoint whose
   decision changed (it became pending or promoted meanwhile) is skipped.  The
   pending keys are read once more before each checkpoint.
3. **Deletes**: the plan's batches in order (completeness markers first), each
   finished before the next starts; a failed batch stops that checkpoint.
4. **Transitions**, two ways:

   * *bucket lifecycle* (default where the store supports it): each object to
     move gets the tag ``ckptfs-tier=<CLASS>`` (other tags kept) and the bucket
     gets one tag-filtered Transition rule per tier (``Days`` 0, so the
     provider moves tagged objects on its next lifecycle run) plus an
     AbortIncompleteMultipartUpload rule.  Provider transitions keep
     LastModified, data, metadata and tags.
   * *direct* (``--direct``, or stores without lifecycle support such as
     ``file://``): each object is copied onto itself with the new storage class
     (metadata kept, ``if_match`` = the listed ETag), tags re-applied after the
     copy.

   Either way the object also gets ``ckptfs-mtime`` = its original
   modification time, because a copy in place resets LastModified (and so does
   PutObjectTagging on radosgw 16.2), which would make the checkpoint look young
   again.  The planner reads that tag (``lifecycle.catalog.MTIME_TAG``).

Everything is idempotent: a second run finds nothing to delete, objects already
in their class (or already tagged and waiting for the provider) and the bucket
rules already in place, changes nothing and logs "nothing to do".
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import trio

from ckptfs.drain.store import (
    NotFoundError,
    NotSupportedError,
    PreconditionFailedError,
    StoreError,
    collapse_exception_group,
)
from ckptfs.fsmeta import cluster, durability
from ckptfs.fsmeta.layout import CacheDir
from ckptfs.fsmeta.settings import parse_store_url

from .catalog import MTIME_TAG, ListedObject, effective_mtime
from .pins import is_reserved_key, pins_from_keys, read_pins
from .planner import DELETE, KEEP, TRANSITION, CheckpointPlan, Plan, _pending_covers, plan
from .rules import LifecycleRules
from .storage_classes import MIN_TRANSITION_AGE_DAYS, STANDARD, normalize_storage_class

log = logging.getLogger("ckptfs.lifecycle")

#: Object tag naming the class an object should be in; the bucket rules filter on it.
TIER_TAG = "ckptfs-tier"
#: Every bucket lifecycle rule ckptfs writes has an ID starting with this.
RULE_ID_PREFIX = "ckptfs-"
#: AbortIncompleteMultipartUpload after this many days: long enough that a
#: node down over a weekend can still resume its uploads (drain resume).
ABORT_INCOMPLETE_DAYS = 7
#: Parallel requests for tag reads, tagging and copies.
DEFAULT_CONCURRENCY = 16
#: S3 allows at most 10 tags per object.
MAX_TAGS = 10

PendingSource = Callable[[], Iterable[str]]


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    listing: tuple[ListedObject, ...]  # the store without ckptfs' reserved keys
    pins: tuple[str, ...]
    pending: frozenset[str]
    plan: Plan


async def list_bucket(
    store, *, fetch_tags: bool = True, concurrency: int = DEFAULT_CONCURRENCY
) -> tuple[list[ListedObject], list[str]]:
    """(listing for the planner, pinned paths) from one listing of the store.

    Tags are read (one GetObjectTagging each) only for objects outside
    STANDARD: those are the only ones whose LastModified ckptfs may have reset,
    so the only ones whose ``ckptfs-mtime`` matters.
    """
    objects = []
    reserved = []
    async for page in store.list_pages(""):
        for obj in page.objects:
            (reserved if is_reserved_key(obj.key) else objects).append(obj)
    tags: dict[str, dict[str, str]] = {}
    if fetch_tags:
        wanted = [o.key for o in objects if normalize_storage_class(o.storage_class) != STANDARD]

        async def one(key: str) -> None:
            try:
                tags[key] = await store.get_tags(key)
            except NotFoundError:
                pass  # deleted since the listing; the plan's work on it is idempotent
            except NotSupportedError:
                pass

        await _for_each(wanted, one, concurrency)
    listing = [
        ListedObject(
            key=o.key,
            size=o.size,
            last_modified=o.last_modified,
            storage_class=normalize_storage_class(o.storage_class),
            tags=tags.get(o.key),
            etag=o.etag,
        )
        for o in objects
    ]
    return listing, pins_from_keys(o.key for o in reserved)


async def read_pending(pending: PendingSource | None) -> frozenset[str]:
    if pending is None:
        return frozenset()
    return frozenset(await trio.to_thread.run_sync(lambda: list(pending())))


async def read_in_flight(store) -> frozenset[str]:
    """The directories (``dir/``) that some node's cache holds files of that the bucket lacks:
    its in-flight records of cluster commit (fsmeta/cluster.py). A checkpoint there is being
    written, whatever its marker says: never tiered or deleted."""
    out = set()
    for obj in (await store.list(cluster.INFLIGHT_PREFIX)).objects:
        parsed = cluster.parse_record_key(obj.key)
        if parsed is not None:
            out.add(parsed[0] + "/" if parsed[0] else "")
    return frozenset(out)


async def gather_inputs(
    store, rules: LifecycleRules, now: datetime, *, pending: PendingSource | None = None, fetch_tags: bool = True
) -> Inputs:
    """List the store, read pins and local pending keys, and plan."""
    listing, pins = await list_bucket(store, fetch_tags=fetch_tags)
    pending_keys = await read_pending(pending) | await read_in_flight(store)
    the_plan = plan(listing, rules, pins, now, pending_keys)
    return Inputs(tuple(listing), tuple(pins), pending_keys, the_plan)


# --------------------------------------------------------------------------- local pending keys


class CacheMismatch(Exception):
    """The cache directory belongs to another bucket/prefix than the store."""


def read_local_pending(cache_dir: str, store_url: str) -> set[str]:
    """Keys (relative to ``store_url``'s prefix) that a local ckptfs cache has not
    made durable yet: pending files (every hard-link name) and directories
    (``path/``, which covers everything below), the bucket objects pending
    inodes (and the subtrees of pending directories) still have their content
    at (sources of renames not yet copied), in-flight multipart uploads and
    queued bucket deletes (tombstones).  Raises :class:`CacheMismatch` if the cache belongs to
    an unrelated bucket, FileNotFoundError if there is no cache there."""
    meta = CacheDir(cache_dir).open_meta()
    try:
        with meta.read() as txn:
            settings = txn.get_settings() or {}
            cache_url = settings.get("bucket_url")
            if not cache_url:
                raise CacheMismatch(f"cache directory {cache_dir} does not record a bucket URL")
            to_store = key_mapper(cache_url, store_url)
            if to_store is None:
                raise CacheMismatch(
                    f"cache directory {cache_dir} belongs to {cache_url}, not to {store_url}; its pending keys are ignored"
                )
            raw = durability.pending_keys(txn)
    finally:
        meta.close()
    out = set()
    for key in raw:
        mapped = to_store(key)
        if mapped is not None:
            out.add(mapped)
    return out


def key_mapper(cache_url: str, store_url: str) -> Callable[[str], str | None] | None:
    """Map a key relative to ``cache_url`` to one relative to ``store_url``.

    None if the two do not overlap (different bucket, disjoint prefixes); the
    mapper returns None for keys outside the store's prefix."""
    try:
        c, s = parse_store_url(cache_url), parse_store_url(store_url)
    except ValueError:
        return None
    if c.scheme != s.scheme:
        return None
    if c.scheme == "s3":
        if c.bucket != s.bucket:
            return None
        cp, sp = c.prefix, s.prefix  # "" or "a/b/"
    else:
        cp, sp = c.path.rstrip("/") + "/", s.path.rstrip("/") + "/"
    if cp.startswith(sp):
        extra = cp[len(sp) :]
        return lambda key: extra + key
    if sp.startswith(cp):
        strip = sp[len(cp) :]

        def inside(key: str) -> str | None:
            if key.startswith(strip):
                return key[len(strip) :]
            if key.endswith("/") and strip.startswith(key):
                return ""  # a pending directory above the store prefix covers all of it
            return None

        return inside
    return None


# --------------------------------------------------------------------------- bucket lifecycle rules


def store_prefix(store) -> str:
    """The store's key prefix in its bucket ("" or "a/b/")."""
    return getattr(store, "prefix", "") or ""


def rule_id_base(prefix: str) -> str:
    """``ckptfs-<8 hex>``: the rules of one store prefix.  Several ckptfs
    prefixes can share a bucket without rewriting each other's rules."""
    return RULE_ID_PREFIX + hashlib.sha256(prefix.encode()).hexdigest()[:8]


def transition_days(storage_class: str) -> int:
    """Days for a Transition rule: 0 (move tagged objects at the provider's next
    lifecycle run; the planner already decided they are old enough), except
    where AWS requires more (30 for STANDARD_IA / ONEZONE_IA)."""
    return MIN_TRANSITION_AGE_DAYS.get(storage_class, 0)


def _tag_filter(prefix: str, tag: Mapping[str, str]) -> dict:
    if prefix:
        return {"And": {"Prefix": prefix, "Tags": [dict(tag)]}}
    return {"Tag": dict(tag)}


def desired_bucket_rules(prefix: str, rules: LifecycleRules, *, abort_days: int = ABORT_INCOMPLETE_DAYS) -> list[dict]:
    """The bucket lifecycle rules ckptfs wants for the store at ``prefix``."""
    base = rule_id_base(prefix)
    out = []
    for tier in rules.tiers:
        out.append(
            {
                "ID": f"{base}-tier-{tier.storage_class}",
                "Status": "Enabled",
                "Filter": _tag_filter(prefix, {"Key": TIER_TAG, "Value": tier.storage_class}),
                "Transitions": [{"Days": transition_days(tier.storage_class), "StorageClass": tier.storage_class}],
            }
        )
    out.append(
        {
            "ID": f"{base}-abort-incomplete-uploads",
            "Status": "Enabled",
            "Filter": {"Prefix": prefix},
            "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": abort_days},
        }
    )
    return out


def _filter_parts(rule: Mapping[str, Any]) -> dict:
    """A rule's filter as {prefix, tags, size bounds}, whatever shape it came in
    (AWS ``And``, radosgw 16.2's ``{Prefix, Tag}`` without ``And``, legacy
    top-level ``Prefix``)."""
    f = rule.get("Filter")
    if not isinstance(f, Mapping):
        return {"Prefix": rule.get("Prefix", "") or "", "Tags": []}
    src = f.get("And") if isinstance(f.get("And"), Mapping) else f
    tags = list(src.get("Tags") or [])
    if isinstance(f.get("Tag"), Mapping):
        tags.append(dict(f["Tag"]))
    out: dict[str, Any] = {"Prefix": src.get("Prefix", f.get("Prefix", "")) or ""}
    out["Tags"] = sorted(({"Key": t["Key"], "Value": t.get("Value", "")} for t in tags), key=lambda t: (t["Key"], t["Value"]))
    for name in ("ObjectSizeGreaterThan", "ObjectSizeLessThan"):
        value = src.get(name, f.get(name))
        if value is not None:
            out[name] = value
    return out


def normalize_rule(rule: Mapping[str, Any]) -> dict:
    """A rule as read back from the bucket, in a shape PutBucketLifecycle accepts.

    radosgw 16.2 returns an ``And{Prefix, Tag}`` filter as ``{Prefix, Tag}``
    (no ``And``), which no server accepts back; rebuild the ``And``.
    """
    out = dict(rule)
    f = rule.get("Filter")
    if isinstance(f, Mapping) and "And" not in f:
        predicates = [k for k in ("Prefix", "Tag", "ObjectSizeGreaterThan", "ObjectSizeLessThan") if k in f]
        if len(predicates) > 1:
            parts = _filter_parts(rule)
            and_: dict[str, Any] = {}
            if parts["Prefix"]:
                and_["Prefix"] = parts["Prefix"]
            if parts["Tags"]:
                and_["Tags"] = parts["Tags"]
            for name in ("ObjectSizeGreaterThan", "ObjectSizeLessThan"):
                if name in parts:
                    and_[name] = parts[name]
            out["Filter"] = {"And": and_}
    return out


def _canonical(rules: Iterable[Mapping[str, Any]]) -> str:
    items = []
    for rule in rules:
        r = {k: v for k, v in rule.items() if k not in ("Filter", "Prefix")}
        r["Filter"] = _filter_parts(rule)
        items.append(r)
    items.sort(key=lambda r: str(r.get("ID", "")))
    return json.dumps(items, sort_keys=True, default=str)


def owns_rule(rule: Mapping[str, Any], prefix: str) -> bool:
    return str(rule.get("ID", "")).startswith(rule_id_base(prefix) + "-")


async def sync_bucket_lifecycle(store, rules: LifecycleRules) -> bool:
    """Install ckptfs' rules for this store's prefix, keeping every other rule.

    True if the configuration was written, False if it already matched.
    Raises NotSupportedError where the store has no bucket lifecycle."""
    prefix = store_prefix(store)
    existing = await store.get_bucket_lifecycle()
    ours = [r for r in existing if owns_rule(r, prefix)]
    others = [normalize_rule(r) for r in existing if not owns_rule(r, prefix)]
    desired = desired_bucket_rules(prefix, rules)
    if _canonical(ours) == _canonical(desired):
        return False
    for rule in desired:
        log.info("bucket lifecycle: install rule %s", _describe_rule(rule))
    for rule in ours:
        if rule.get("ID") not in {r["ID"] for r in desired}:
            log.info("bucket lifecycle: remove rule %s (no longer configured)", rule.get("ID"))
    if others:
        log.info("bucket lifecycle: keeping %d rule(s) ckptfs did not write: %s", len(others),
                 ", ".join(str(r.get("ID", "?")) for r in others))
    await store.put_bucket_lifecycle(others + desired)
    return True


def _describe_rule(rule: Mapping[str, Any]) -> str:
    parts = _filter_parts(rule)
    what = f"{rule['ID']}: prefix {parts['Prefix']!r}"
    if parts["Tags"]:
        what += " tag " + ",".join(f"{t['Key']}={t['Value']}" for t in parts["Tags"])
    for t in rule.get("Transitions", []):
        what += f" -> {t['StorageClass']} after {t['Days']} day(s)"
    if "AbortIncompleteMultipartUpload" in rule:
        what += f" abort incomplete multipart uploads after {rule['AbortIncompleteMultipartUpload']['DaysAfterInitiation']} day(s)"
    return what


# --------------------------------------------------------------------------- results


# Result statuses of one checkpoint.
DONE = "done"  # every object deleted / tagged / copied
WAITING = "waiting"  # tagged by an earlier run; the bucket's lifecycle rules will move them
SKIPPED = "skipped"  # not executed (changed since planning, stopping, object changed)
FAILED = "failed"  # an error; see errors


@dataclass
class CheckpointResult:
    path: str
    action: str
    target_class: str | None
    status: str
    detail: str = ""
    deleted: int = 0
    tagged: int = 0
    copied: int = 0
    waiting: int = 0  # already tagged, waiting for the provider
    unchanged: int = 0  # skipped objects (gone or changed since the listing)
    errors: list[str] = field(default_factory=list)

    @property
    def changes(self) -> int:
        return self.deleted + self.tagged + self.copied

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "detail": self.detail,
            "deleted": self.deleted,
            "tagged": self.tagged,
            "copied": self.copied,
            "waiting": self.waiting,
            "errors": list(self.errors),
        }


@dataclass
class ApplyReport:
    plan: Plan
    mode: str  # "bucket-lifecycle" or "direct"
    bucket_rules: str  # "updated", "unchanged", "not-supported", "not-used" (--direct), "failed"
    results: list[CheckpointResult]
    errors: list[str] = field(default_factory=list)

    @property
    def changes(self) -> int:
        return sum(r.changes for r in self.results) + (self.bucket_rules == "updated")

    @property
    def ok(self) -> bool:
        return not self.errors and all(r.status != FAILED for r in self.results)

    def result_for(self, path: str) -> CheckpointResult | None:
        return next((r for r in self.results if r.path == path), None)

    def summary_line(self) -> str:
        deleted = sum(r.deleted for r in self.results)
        ckpt_deleted = sum(1 for r in self.results if r.action == DELETE and r.deleted)
        tagged = sum(r.tagged for r in self.results)
        copied = sum(r.copied for r in self.results)
        waiting = sum(r.waiting for r in self.results)
        skipped = sum(1 for r in self.results if r.status == SKIPPED)
        failed = sum(1 for r in self.results if r.status == FAILED)
        if self.changes == 0 and not failed and not self.errors:
            line = "nothing to do"
            if waiting:
                line += f" ({waiting} object(s) tagged earlier, waiting for the bucket lifecycle rules)"
            if skipped:
                line += f"; {skipped} checkpoint(s) skipped"
            return line
        parts = []
        if deleted or ckpt_deleted:
            parts.append(f"deleted {deleted} object(s) of {ckpt_deleted} checkpoint(s)")
        if copied:
            parts.append(f"moved {copied} object(s) by copy")
        if tagged:
            parts.append(f"tagged {tagged} object(s) for the bucket lifecycle rules")
        if waiting:
            parts.append(f"{waiting} object(s) already tagged, waiting for the bucket lifecycle rules")
        if self.bucket_rules == "updated":
            parts.append("bucket lifecycle rules updated")
        if skipped:
            parts.append(f"{skipped} checkpoint(s) skipped")
        if failed or self.errors:
            parts.append(f"{failed + len(self.errors)} failure(s)")
        return "; ".join(parts)


# --------------------------------------------------------------------------- executing


async def execute(
    store,
    rules: LifecycleRules,
    inputs: Inputs,
    *,
    direct: bool = False,
    pending: PendingSource | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    should_stop: Callable[[], bool] | None = None,
) -> ApplyReport:
    """Carry out ``inputs.plan``.  Never raises a StoreError: failures are
    logged and recorded in the report (``report.ok`` is then False)."""
    the_plan = inputs.plan
    url = getattr(store, "url", "")
    errors: list[str] = []

    # Re-check pins and local pending keys right before executing.
    try:
        pins_now = await read_pins(store)
    except StoreError as exc:
        return ApplyReport(the_plan, "direct" if direct else "bucket-lifecycle", "not-used", [], [f"reading pins: {exc}"])
    pending_now = await read_pending(pending) | await read_in_flight(store)
    replanned = {e.path: e for e in plan(inputs.listing, rules, pins_now, the_plan.now, pending_now).checkpoints}

    mode = "direct" if direct else "bucket-lifecycle"
    bucket_rules = "not-used"
    rules_ok = True
    if not direct:
        try:
            bucket_rules = "updated" if await sync_bucket_lifecycle(store, rules) else "unchanged"
        except NotSupportedError:
            mode, bucket_rules = "direct", "not-supported"
            log.info("%s has no bucket lifecycle support: transitions are made by copying objects in place", url)
        except StoreError as exc:
            bucket_rules, rules_ok = "failed", False
            msg = f"cannot install the bucket lifecycle rules: {exc}"
            if any(e.action == TRANSITION for e in the_plan.checkpoints):
                # Tiering depends on them: a failure of this run.
                msg += "; tiering skipped (try --direct, or check lifecycle.tiers[].storage_class)"
                log.error("%s", msg)
                errors.append(msg)
            else:
                # Nothing to tier now; deletes go ahead.  Still worth a warning
                # (the AbortIncompleteMultipartUpload rule is missing).
                log.warning("%s", msg)

    results: list[CheckpointResult] = []
    for entry in the_plan.actions:
        result = CheckpointResult(entry.path, entry.action, entry.target_class, DONE)
        results.append(result)
        if should_stop is not None and should_stop():
            result.status, result.detail = SKIPPED, "stopping"
            continue
        now_entry = replanned.get(entry.path)
        if now_entry is None or now_entry.action != entry.action or now_entry.target_class != entry.target_class:
            why = ", ".join(now_entry.reasons) if now_entry is not None else "gone"
            result.status, result.detail = SKIPPED, f"changed since planning ({why})"
            log.warning("%s: skipped, %s", entry.path, result.detail)
            continue
        fresh = await read_pending(pending) | await read_in_flight(store)
        if any(_pending_covers(p.lstrip("/"), entry.path) for p in fresh):
            result.status, result.detail = SKIPPED, "became pending in a node's cache"
            log.warning("%s: skipped, %s", entry.path, result.detail)
            continue
        try:
            if entry.action == DELETE:
                await _delete(store, entry, result)
            elif entry.action == TRANSITION:
                if mode == "direct":
                    await _transition_by_copy(store, entry, result, concurrency)
                elif rules_ok:
                    await _transition_by_tag(store, entry, result, concurrency)
                else:
                    result.status, result.detail = FAILED, "bucket lifecycle rules could not be installed"
        except StoreError as exc:  # pragma: no cover - _delete/_transition record their own
            result.errors.append(str(exc))
        _finish(result)
    report = ApplyReport(the_plan, mode, bucket_rules, results, errors)
    line = report.summary_line()
    (log.info if report.ok else log.error)("%s", line)
    return report


def _finish(result: CheckpointResult) -> None:
    if result.status == SKIPPED:
        return
    if result.errors:
        result.status = FAILED
        if not result.detail:
            result.detail = result.errors[0]
    elif result.changes == 0 and result.waiting:
        result.status = WAITING
        result.detail = result.detail or "tagged earlier; waiting for the bucket lifecycle rules"
    elif result.changes == 0 and result.unchanged:
        result.status = SKIPPED
    elif result.status != FAILED:
        result.status = DONE


async def _delete(store, entry: CheckpointPlan, result: CheckpointResult) -> None:
    reason = ", ".join(entry.reasons)
    batches = entry.delete_batches
    log.info("%s: delete %d object(s) in %d batch(es) (%s)", entry.path, len(entry.delete_keys), len(batches), reason)
    for index, batch in enumerate(batches, 1):
        for key in batch:
            log.info("delete %s (batch %d/%d)", key, index, len(batches))
        try:
            failed = await store.delete_many(batch)
        except StoreError as exc:
            failed = {key: exc for key in batch}
        result.deleted += len(batch) - len(failed)
        if failed:
            for key, exc in failed.items():
                result.errors.append(f"delete {key}: {exc}")
                log.error("delete %s failed: %s", key, exc)
            log.error("%s: stopped after batch %d of %d; the rest stays for the next run", entry.path, index, len(batches))
            return


def _mtime_value(obj: ListedObject) -> str:
    when, _ = effective_mtime(obj)
    return when.astimezone(timezone.utc).isoformat()


def _wanted_tags(current: Mapping[str, str], obj: ListedObject, target: str) -> dict[str, str]:
    want = dict(current)
    want[TIER_TAG] = target
    want.setdefault(MTIME_TAG, _mtime_value(obj))
    return want


async def _transition_by_tag(store, entry: CheckpointPlan, result: CheckpointResult, concurrency: int) -> None:
    target = entry.target_class
    assert target is not None
    log.info("%s: tag %d object(s) %s=%s for the bucket lifecycle rules (%s)", entry.path,
             len(entry.transition_objects), TIER_TAG, target, ", ".join(entry.reasons))

    async def one(obj: ListedObject) -> None:
        try:
            current = await store.get_tags(obj.key)
        except NotFoundError:
            result.unchanged += 1
            log.warning("%s: gone since the listing; not tagged", obj.key)
            return
        want = _wanted_tags(current, obj, target)
        if want == current:
            result.waiting += 1
            log.debug("%s: already tagged %s=%s", obj.key, TIER_TAG, target)
            return
        if len(want) > MAX_TAGS:
            result.errors.append(f"{obj.key}: has {len(current)} tags; no room for {TIER_TAG}/{MTIME_TAG}")
            log.error("%s", result.errors[-1])
            return
        try:
            await store.put_tags(obj.key, want)
        except NotFoundError:
            result.unchanged += 1
            return
        except StoreError as exc:
            result.errors.append(f"tag {obj.key}: {exc}")
            log.error("tag %s failed: %s", obj.key, exc)
            return
        result.tagged += 1
        log.info("tag %s %s=%s %s=%s", obj.key, TIER_TAG, target, MTIME_TAG, want[MTIME_TAG])

    await _for_each(_movable(entry), one, concurrency)


def _movable(entry: CheckpointPlan) -> list[ListedObject]:
    """The objects to move, without zero-byte directory placeholders ("dir/"):
    nothing to tier there, and file:// cannot copy them.  (Only reachable with
    min_transition_bytes = 0.)"""
    out = []
    for obj in entry.transition_objects:
        if obj.key.endswith("/"):
            log.debug("%s: directory placeholder, not moved", obj.key)
        else:
            out.append(obj)
    return out


async def _transition_by_copy(store, entry: CheckpointPlan, result: CheckpointResult, concurrency: int) -> None:
    target = entry.target_class
    assert target is not None
    log.info("%s: copy %d object(s) in place to %s (%s)", entry.path, len(entry.transition_objects), target,
             ", ".join(entry.reasons))

    async def one(obj: ListedObject) -> None:
        try:
            current = await store.get_tags(obj.key)
            want = _wanted_tags(current, obj, target)
            if len(want) > MAX_TAGS:
                want = dict(current)  # no room: move it anyway, without our tags
                log.warning("%s: has %d tags; moved without %s/%s", obj.key, len(current), TIER_TAG, MTIME_TAG)
            if want != current:
                # Before the copy, so that the copy (which keeps tags) already carries
                # the original time even if we are interrupted right after it.
                await store.put_tags(obj.key, want)
            await store.copy(obj.key, obj.key, None, storage_class=target, if_match=obj.etag)
            # Some servers drop or ignore tags on copies (radosgw 16.2 with
            # MetadataDirective=REPLACE): make sure they are there.
            if await store.get_tags(obj.key) != want:
                await store.put_tags(obj.key, want)
        except PreconditionFailedError:
            result.unchanged += 1
            log.warning("%s: changed since the listing (ETag); not moved", obj.key)
            return
        except NotFoundError:
            result.unchanged += 1
            log.warning("%s: gone since the listing; not moved", obj.key)
            return
        except StoreError as exc:
            result.errors.append(f"copy {obj.key} to {target}: {exc}")
            log.error("copy %s to %s failed: %s", obj.key, target, exc)
            return
        result.copied += 1
        log.info("copy %s -> %s (in place) %s=%s", obj.key, target, MTIME_TAG, want.get(MTIME_TAG, "-"))

    await _for_each(_movable(entry), one, concurrency)


async def _for_each(items: Sequence, fn, concurrency: int) -> None:
    if not items:
        return
    limiter = trio.Semaphore(max(1, concurrency))

    async def run(item) -> None:
        async with limiter:
            await fn(item)

    try:
        async with trio.open_nursery() as nursery:
            for item in items:
                nursery.start_soon(run, item)
    except BaseExceptionGroup as group:
        raise collapse_exception_group(group) from None


# --------------------------------------------------------------------------- one run


async def run_once(
    store,
    rules: LifecycleRules,
    now: datetime,
    *,
    apply: bool,
    direct: bool = False,
    pending: PendingSource | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[Inputs, ApplyReport | None]:
    """Plan (and with ``apply``, execute) once."""
    inputs = await gather_inputs(store, rules, now, pending=pending)
    if not apply:
        return inputs, None
    # Executed even when the plan has no actions: the bucket rules are still
    # checked (and installed if missing).
    report = await execute(store, rules, inputs, direct=direct, pending=pending, concurrency=concurrency,
                           should_stop=should_stop)
    return inputs, report


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


__all__ = [
    "ABORT_INCOMPLETE_DAYS",
    "ApplyReport",
    "CacheMismatch",
    "CheckpointResult",
    "Inputs",
    "KEEP",
    "RULE_ID_PREFIX",
    "TIER_TAG",
    "desired_bucket_rules",
    "execute",
    "gather_inputs",
    "key_mapper",
    "list_bucket",
    "normalize_rule",
    "owns_rule",
    "read_local_pending",
    "rule_id_base",
    "run_once",
    "sync_bucket_lifecycle",
    "transition_days",
]
