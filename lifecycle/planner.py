"""The retention/tiering planner: a pure function from a listing to a Plan.

``plan()`` does no I/O and reads no clock; ``now`` is an argument so that a
plan can be reproduced and property-tested.  The Plan carries the concrete
per-object work (delete batches in safe order, objects to transition) so an
executor can carry it out without re-deriving anything.  See
docs/LIFECYCLE.md for the decision procedure and reason vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from types import MappingProxyType
from typing import Literal

from .catalog import FILE, Catalog, Checkpoint, ListedObject, Series, build_catalog
from .rules import LifecycleRules, Tier
from .storage_classes import ARCHIVE_CLASSES, BYTES_PER_BILLED_GB, COLDNESS

Action = Literal["keep", "transition", "delete"]
KEEP: Action = "keep"
TRANSITION: Action = "transition"
DELETE: Action = "delete"

# Why a checkpoint is kept.
LATEST = "latest"  # among the newest max(keep_latest, 1) complete checkpoints
MILESTONE = "milestone"  # step is a multiple of keep_every_steps
GEOMETRIC = "geometric"  # first complete checkpoint at/after s0 * keep_geometric**k
PROMOTED = "promoted"  # pinned by the user
PENDING_UPLOAD = "pending-upload"  # dirty/uploading in the local cache
WITHIN_EXPIRY = "within-expiry"  # younger than expire_after_days
NO_EXPIRY_RULE = "no-expiry-rule"  # expire_after_days is not set
INCOMPLETE_NEWEST = "incomplete-newest"  # newer than the newest complete one: maybe in flight
INCOMPLETE_WITHIN_GRACE = "incomplete-within-grace"  # older, but idle <= incomplete_grace_hours
INCOMPLETE_NO_GRACE_RULE = "incomplete-no-grace-rule"  # older, but incomplete_grace_hours not set
# Why a checkpoint is deleted.
EXPIRED = "expired"
INCOMPLETE_STALE = "incomplete-stale"
# Notes on tiering.
BELOW_MIN_TRANSITION_SIZE = "below-min-transition-size"  # some objects too small to move
ARCHIVED_NOT_TRANSITIONED = "archived-not-transitioned"  # some objects need a restore to move

# Reasons that forbid deleting and tiering outright.
_PROTECTING = frozenset({LATEST, PROMOTED, PENDING_UPLOAD})


def tier_reason(tier: Tier) -> str:
    return f"tier:{tier.storage_class} after {tier.after_days:g}d"


@dataclass(frozen=True)
class CheckpointPlan:
    """The decision for one checkpoint, plus the per-object work it implies."""

    series: str
    path: str
    step: int
    kind: Literal["directory", "file"]
    complete: bool
    bytes: int
    objects: int
    storage_class: str  # the objects' class, or "mixed"
    last_modified: datetime
    age_days: float
    action: Action
    target_class: str | None  # set iff action == "transition"
    reasons: tuple[str, ...]
    # Deletes: run the batches in order, each one finished (and checked)
    # before the next starts.  For a directory the first batch is its
    # completeness markers, so an interrupted delete never leaves a partial
    # checkpoint that looks complete.  Within a batch, any order / bulk delete.
    delete_batches: tuple[tuple[str, ...], ...] = ()
    # Objects to move to target_class (already filtered: not in target or a
    # colder class, not archived, not below rules.min_transition_bytes).
    transition_objects: tuple[ListedObject, ...] = ()

    @property
    def delete_keys(self) -> tuple[str, ...]:
        return tuple(key for batch in self.delete_batches for key in batch)

    @property
    def transition_keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.transition_objects)

    @property
    def transition_bytes(self) -> int:
        return sum(o.size for o in self.transition_objects)


@dataclass(frozen=True)
class PlanSummary:
    """Whole-bucket totals (checkpoints AND unmanaged objects) before/after."""

    bytes_before: Mapping[str, int]  # storage class -> bytes
    bytes_after: Mapping[str, int]
    cost_before: float | None  # $/month over priced classes; None without prices
    cost_after: float | None
    unpriced_classes: tuple[str, ...]  # classes holding bytes but lacking a price
    checkpoints: int
    kept: int
    transitioned: int
    deleted: int
    objects_deleted: int
    bytes_deleted: int
    objects_transitioned: int
    bytes_transitioned: int
    unmanaged_objects: int
    unmanaged_bytes: int


@dataclass(frozen=True)
class Plan:
    now: datetime
    checkpoints: tuple[CheckpointPlan, ...]  # by series name, then oldest first
    summary: PlanSummary
    warnings: tuple[str, ...]

    @property
    def actions(self) -> tuple[CheckpointPlan, ...]:
        """Entries that need work (transition or delete)."""
        return tuple(c for c in self.checkpoints if c.action != KEEP)


def plan(
    listing: Iterable[object],
    rules: LifecycleRules,
    pins: Iterable[str],
    now: datetime,
    local_pending: Iterable[str] = frozenset(),
) -> Plan:
    """Decide keep/transition/delete for every checkpoint in ``listing``.

    ``pins``: checkpoint paths the user promoted; a pin also covers every
    checkpoint below it (pin ``run1`` keeps all of run1) and the checkpoint it
    lies in.  ``local_pending``: keys or raw key prefixes dirty/uploading in a
    local cache; any checkpoint overlapping one is left entirely alone.
    """
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    catalog = build_catalog(listing, rules)
    pin_paths = tuple(sorted({p.strip("/") for p in pins} - {""}))
    pending = tuple(sorted({p.lstrip("/") for p in local_pending}))

    entries: list[CheckpointPlan] = []
    for series in catalog.series:
        entries.extend(_plan_series(series, rules, pin_paths, pending, now))

    warnings = list(catalog.warnings)
    for series in catalog.series:
        if series.checkpoints and not series.complete:
            why = (
                "lifecycle.markers is empty, so a directory checkpoint is never complete"
                if not rules.markers and any(c.kind != FILE for c in series.checkpoints)
                else "no completeness marker found"
            )
            warnings.append(
                f"{series.name}: no complete checkpoint ({why}); nothing in this series is deleted or tiered"
            )
    for pin in pin_paths:
        if not any(_pin_covers(pin, c.path) for c in catalog.checkpoints):
            warnings.append(f"pin {pin!r} matches no checkpoint in the listing")

    entries_t = tuple(entries)
    return Plan(now, entries_t, _summarize(catalog, entries_t, rules), tuple(warnings))


def apply_plan(listing: Iterable[object], the_plan: Plan) -> list[ListedObject]:
    """The listing as it would be after executing ``the_plan`` (simulation).

    Deleted keys disappear and transitioned keys change class; LastModified is
    kept, as S3 lifecycle transitions keep it (see MTIME_TAG for copy-in-place).
    """
    deleted: set[str] = set()
    moved: dict[str, str] = {}
    for entry in the_plan.checkpoints:
        deleted.update(entry.delete_keys)
        for obj in entry.transition_objects:
            moved[obj.key] = entry.target_class  # type: ignore[assignment]
    result = []
    for raw in listing:
        obj = ListedObject.coerce(raw)
        if obj.key in deleted:
            continue
        if obj.key in moved:
            obj = replace(obj, storage_class=moved[obj.key])
        result.append(obj)
    return result


# --------------------------------------------------------------------------- per series


def _plan_series(
    series: Series, rules: LifecycleRules, pins: tuple[str, ...], pending: tuple[str, ...], now: datetime
) -> list[CheckpointPlan]:
    complete = series.complete  # oldest first
    newest_complete = complete[-1] if complete else None
    # The newest complete checkpoint is the only safe resume point, so it is
    # kept even with keep_latest = 0 or unset.
    keep_latest = max(rules.keep_latest or 0, 1)
    latest = {c.path for c in complete[-keep_latest:]}
    geometric = _geometric_keep([c.step for c in complete], rules.keep_geometric) if rules.keep_geometric else set()

    entries = []
    for cp in series.checkpoints:
        age_days = (now - cp.last_modified).total_seconds() / 86400
        reasons: list[str] = []
        if cp.complete:
            if cp.path in latest:
                reasons.append(LATEST)
            if rules.keep_every_steps and cp.step % rules.keep_every_steps == 0:
                reasons.append(MILESTONE)
            if cp.step in geometric:
                reasons.append(GEOMETRIC)
        if any(_pin_covers(pin, cp.path) for pin in pins):
            reasons.append(PROMOTED)
        if any(_pending_covers(prefix, cp.path) for prefix in pending):
            reasons.append(PENDING_UPLOAD)
        protected = not _PROTECTING.isdisjoint(reasons)

        action: Action = KEEP
        target: str | None = None
        delete_batches: tuple[tuple[str, ...], ...] = ()
        transitions: tuple[ListedObject, ...] = ()
        if not cp.complete:
            if newest_complete is None or cp.order_key > newest_complete.order_key:
                status = INCOMPLETE_NEWEST
            elif rules.incomplete_grace_hours is None:
                status = INCOMPLETE_NO_GRACE_RULE
            elif age_days * 24 > rules.incomplete_grace_hours:
                status = INCOMPLETE_STALE
            else:
                status = INCOMPLETE_WITHIN_GRACE
            reasons.append(status)
            # Incomplete checkpoints are never tiered: they are either in
            # flight or garbage, and tiering garbage only adds charges.
            if status == INCOMPLETE_STALE and not protected:
                action = DELETE
        elif not protected:
            retained = MILESTONE in reasons or GEOMETRIC in reasons
            if not retained and rules.expire_after_days is not None and age_days >= rules.expire_after_days:
                reasons.append(EXPIRED)
                action = DELETE
            else:
                if not retained:
                    reasons.append(WITHIN_EXPIRY if rules.expire_after_days is not None else NO_EXPIRY_RULE)
                target, transitions, notes = _tier_decision(cp, age_days, rules)
                if transitions:
                    action = TRANSITION
                    reasons.append(tier_reason(_tier_by_class(rules.tiers, target)))
                else:
                    target = None
                reasons.extend(notes)
        if action == DELETE:
            delete_batches = _delete_batches(cp)

        entries.append(
            CheckpointPlan(
                series=series.name,
                path=cp.path,
                step=cp.step,
                kind=cp.kind,
                complete=cp.complete,
                bytes=cp.bytes,
                objects=len(cp.objects),
                storage_class=cp.storage_class,
                last_modified=cp.last_modified,
                age_days=age_days,
                action=action,
                target_class=target,
                reasons=tuple(reasons),
                delete_batches=delete_batches,
                transition_objects=transitions,
            )
        )
    return entries


def _geometric_keep(steps: list[int], ratio: float) -> set[int]:
    """Steps of the first checkpoint at or after s0 * ratio**k, for every k.

    ``steps`` are the complete checkpoints' steps, ascending.  s0 is the first
    step; if it is 0 (where s0 * ratio**k would stay 0) step 0 is kept and the
    progression starts from the first positive step instead.
    """
    kept: set[int] = set()
    distinct = sorted(set(steps))
    if not distinct:
        return kept
    if distinct[0] == 0:
        kept.add(0)
        distinct = distinct[1:]
        if not distinct:
            return kept
    s0 = distinct[0]
    # Integer ratios use exact integer arithmetic.  Thresholds are always
    # computed as s0 * r**k from k (never by accumulating products) so they do
    # not depend on which checkpoints happen to exist: deleting the thinned-out
    # ones must not change which ones are kept next time.
    r: float | int = int(ratio) if float(ratio).is_integer() else float(ratio)

    def threshold(k: int) -> float | int:
        return s0 * r**k

    def first_k_above(step: int) -> int:
        k = max(0, math.floor(math.log(step / s0) / math.log(r)))
        while k > 0 and threshold(k - 1) > step:
            k -= 1
        while threshold(k) <= step:
            k += 1
        return k

    k = 0
    for step in distinct:
        if step >= threshold(k):
            kept.add(step)
            k = first_k_above(step)
    return kept


def _tier_decision(
    cp: Checkpoint, age_days: float, rules: LifecycleRules
) -> tuple[str | None, tuple[ListedObject, ...], list[str]]:
    """(target class, objects to move, notes) for a tierable checkpoint."""
    due = [i for i, t in enumerate(rules.tiers) if age_days >= t.after_days]
    if not due:
        return None, (), []
    index = due[-1]
    target = rules.tiers[index].storage_class
    position = {t.storage_class: i for i, t in enumerate(rules.tiers)}
    moves: list[ListedObject] = []
    too_small = archived = False
    for obj in cp.objects:
        if obj.key.endswith("/"):
            continue  # a directory marker holds no data: nothing to tier
        if obj.storage_class == target or position.get(obj.storage_class, -1) >= index:
            continue  # already there, or further along the configured tiers
        if COLDNESS.get(obj.storage_class, -1) >= COLDNESS.get(target, math.inf):
            continue  # already colder: moving it would be a restore, not tiering
        if obj.storage_class in ARCHIVE_CLASSES:
            archived = True
        elif obj.size < rules.min_transition_bytes:
            too_small = True
        else:
            moves.append(obj)
    # A note only when it is why the checkpoint stays where it is.  Almost
    # every directory checkpoint has a small marker that never moves; noting
    # that on each of them would bury the notes that matter.
    notes = []
    if not moves and not any(_reached(obj.storage_class, index, rules.tiers) for obj in cp.objects):
        if too_small:
            notes.append(BELOW_MIN_TRANSITION_SIZE)
        if archived:
            notes.append(ARCHIVED_NOT_TRANSITIONED)
    return target, tuple(moves), notes


def _reached(storage_class: str, index: int, tiers: tuple[Tier, ...]) -> bool:
    """Is an object of this class already in tier ``index`` or a later one?"""
    return any(t.storage_class == storage_class for t in tiers[index:])


def _tier_by_class(tiers: tuple[Tier, ...], storage_class: str | None) -> Tier:
    return next(t for t in tiers if t.storage_class == storage_class)


def _delete_batches(cp: Checkpoint) -> tuple[tuple[str, ...], ...]:
    markers = set(cp.marker_keys)
    rest = [o.key for o in cp.objects if o.key not in markers]

    # Directory placeholder objects ("dir/" keys, or a key equal to the
    # checkpoint path) go last, deepest first, so tools that browse the bucket
    # see the directory until its contents are gone.
    def order(key: str) -> tuple[int, int, str]:
        placeholder = key.endswith("/") or key == cp.path
        return (1, -key.count("/"), key) if placeholder else (0, 0, key)

    rest.sort(key=order)
    batches = [tuple(sorted(markers)), tuple(rest)]
    return tuple(b for b in batches if b)


# --------------------------------------------------------------------------- matching


def _pin_covers(pin: str, path: str) -> bool:
    """A pin names a checkpoint, a directory above checkpoints, or a key inside one."""
    return pin == path or path.startswith(pin + "/") or pin.startswith(path + "/")


def _pending_covers(prefix: str, path: str) -> bool:
    """A pending key/prefix touches a checkpoint if it lies inside it or it is a
    raw string prefix of its path ("run1/step_1" also covers "run1/step_10":
    over-protecting something being uploaded is the safe mistake)."""
    return path.startswith(prefix) or prefix.startswith(path + "/") or prefix == path


# --------------------------------------------------------------------------- summary


def _summarize(catalog: Catalog, entries: tuple[CheckpointPlan, ...], rules: LifecycleRules) -> PlanSummary:
    before: dict[str, int] = {}
    after: dict[str, int] = {}

    def add(table: dict[str, int], cls: str, size: int) -> None:
        table[cls] = table.get(cls, 0) + size

    for obj in catalog.unmanaged:
        add(before, obj.storage_class, obj.size)
        add(after, obj.storage_class, obj.size)
    checkpoints = {c.path: c for c in catalog.checkpoints}
    for entry in entries:
        moved = {o.key for o in entry.transition_objects}
        deleted = set(entry.delete_keys)
        for obj in checkpoints[entry.path].objects:
            add(before, obj.storage_class, obj.size)
            if obj.key in deleted:
                continue
            add(after, entry.target_class if obj.key in moved else obj.storage_class, obj.size)  # type: ignore[arg-type]
    for table in (before, after):
        table.update({cls: 0 for cls in (before.keys() | after.keys()) - table.keys()})

    prices = rules.prices
    unpriced: tuple[str, ...] = ()
    cost_before = cost_after = None
    if prices:
        unpriced = tuple(sorted(cls for cls in before if cls not in prices and (before[cls] or after[cls])))
        cost_before = sum(size / BYTES_PER_BILLED_GB * prices[cls] for cls, size in before.items() if cls in prices)
        cost_after = sum(size / BYTES_PER_BILLED_GB * prices[cls] for cls, size in after.items() if cls in prices)

    def sort_classes(table: dict[str, int]) -> Mapping[str, int]:
        return MappingProxyType(dict(sorted(table.items(), key=lambda kv: (COLDNESS.get(kv[0], 99), kv[0]))))

    deletes = [e for e in entries if e.action == DELETE]
    transitions = [e for e in entries if e.action == TRANSITION]
    return PlanSummary(
        bytes_before=sort_classes(before),
        bytes_after=sort_classes(after),
        cost_before=cost_before,
        cost_after=cost_after,
        unpriced_classes=unpriced,
        checkpoints=len(entries),
        kept=sum(1 for e in entries if e.action == KEEP),
        transitioned=len(transitions),
        deleted=len(deletes),
        objects_deleted=sum(len(e.delete_keys) for e in deletes),
        bytes_deleted=sum(e.bytes for e in deletes),
        objects_transitioned=sum(len(e.transition_objects) for e in transitions),
        bytes_transitioned=sum(e.transition_bytes for e in transitions),
        unmanaged_objects=len(catalog.unmanaged),
        unmanaged_bytes=sum(o.size for o in catalog.unmanaged),
    )
