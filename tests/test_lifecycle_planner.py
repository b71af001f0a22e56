"""The retention/tiering planner: property tests of its safety invariants,
plus worked examples of each rule."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from fnmatch import fnmatchcase

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs.lifecycle.catalog import ListedObject
from ckptfs.lifecycle.planner import (
    DELETE,
    KEEP,
    TRANSITION,
    Plan,
    apply_plan,
    plan,
)
from ckptfs.lifecycle.render import plan_to_json, render_table, summary_to_json
from ckptfs.lifecycle.rules import LifecycleRules, Tier
from ckptfs.lifecycle.storage_classes import ARCHIVE_CLASSES, COLDNESS

NOW = datetime(2025, 6, 1, 12, 0, tzinfo=timezone.utc)
DIR_PATTERN = "step_{step}"
FILE_PATTERN = "ckpt-{step}.pt"
MARKERS = (".metadata", "*COMPLETE*")
PARENTS = ("", "run1", "run2/sub", "a-rather-long-experiment-name/with/several/levels/of/nesting")
CLASSES = ("STANDARD", "STANDARD_IA", "GLACIER_IR", "GLACIER", "DEEP_ARCHIVE", "COLD_RGW")
SIZES = (0, 1000, 131071, 131072, 5_000_000, 3 << 30)


# --------------------------------------------------------------------------- scenario generation


@dataclass
class TrueCheckpoint:
    """What the generator knows about a checkpoint, independent of the code under test."""

    series: tuple[str, str]
    path: str
    step: int
    complete: bool
    keys: list[str]
    newest: datetime


@dataclass
class Scenario:
    listing: list[ListedObject]
    truth: list[TrueCheckpoint]
    rules: LifecycleRules
    pins: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)


# Strategies are built once: constructing them inside draws dominated run time.
_TIER_DAYS = st.lists(st.integers(0, 45), unique=True, max_size=3).map(sorted)
_TIER_CLASSES = st.permutations(["STANDARD_IA", "GLACIER_IR", "COLD_RGW", "DEEP_ARCHIVE", "GLACIER"])
_KEEP_LATEST = st.none() | st.integers(0, 4)
_KEEP_EVERY = st.none() | st.sampled_from([100, 500, 1000])
# Geometric thinning keeps most of a short series; draw it less often so that
# the other rules get exercised too.
_KEEP_GEOMETRIC = st.sampled_from([None, None, 2, 1.5, 3, 1.1])
_EXPIRE = st.none() | st.integers(0, 40) | st.floats(0, 40)
_GRACE = st.none() | st.integers(0, 72)
_PRICES = st.sampled_from([{}, {"STANDARD": 0.023, "GLACIER_IR": 0.004}])
_MIN_TRANSITION = st.sampled_from([0, 131072])


@st.composite
def rules_strategy(draw) -> LifecycleRules:
    tier_days = draw(_TIER_DAYS)
    if not tier_days and draw(st.booleans()):
        tier_days = [draw(st.integers(0, 20))]
    tier_classes = draw(_TIER_CLASSES)
    return LifecycleRules(
        checkpoints=(DIR_PATTERN, FILE_PATTERN),
        markers=MARKERS,
        keep_latest=draw(_KEEP_LATEST),
        keep_every_steps=draw(_KEEP_EVERY),
        keep_geometric=draw(_KEEP_GEOMETRIC),
        expire_after_days=draw(_EXPIRE),
        incomplete_grace_hours=draw(_GRACE),
        tiers=tuple(Tier(d, c) for d, c in zip(tier_days, tier_classes[: len(tier_days)], strict=True)),
        prices=draw(_PRICES),
        min_transition_bytes=draw(_MIN_TRANSITION),
    )


_OBJECT_SHAPES = st.lists(st.tuples(st.sampled_from(SIZES), st.sampled_from(CLASSES)), min_size=1, max_size=4)
_PARENTS = st.lists(st.sampled_from(PARENTS), min_size=1, max_size=3, unique=True)
_PATTERNS = st.lists(st.sampled_from([DIR_PATTERN, FILE_PATTERN]), min_size=1, max_size=2, unique=True)
_STEPS = st.lists(st.integers(0, 4000), max_size=8, unique=True)
# Half of the checkpoints are young enough for incomplete_grace_hours to matter.
_AGE_HOURS = st.tuples(st.integers(0, 72) | st.integers(0, 60 * 24), st.sampled_from([0, 0.5])).map(sum)
_SHARDS = st.lists(st.sampled_from(["model", "optim/0", "optim/1", "a/b/c"]), min_size=1, unique=True)
_MARKER_FILES = st.lists(st.sampled_from([".metadata", "x/.metadata", "COMPLETE"]), min_size=1, unique=True)
_DIR_SHAPE = st.tuples(st.booleans(), _SHARDS, st.booleans(), _MARKER_FILES)
_UNMANAGED = st.lists(st.sampled_from(["README", "run1/notes.txt", "logs/train.log", "step_x/y"]), unique=True)
_INDICES = st.lists(st.integers(0, 10**6), max_size=2)
# Sometimes pin a whole run, or something that does not exist.
_DIRECTORY_PIN = st.lists(st.sampled_from([*PARENTS[1:], "no/such/checkpoint"]), max_size=1)


@st.composite
def scenarios(draw) -> Scenario:
    listing: list[ListedObject] = []
    truth: list[TrueCheckpoint] = []

    def add(keys: list[str], newest_age_hours: float) -> datetime:
        shapes = draw(_OBJECT_SHAPES)
        mtimes = []
        for i, key in enumerate(keys):
            size, cls = shapes[i % len(shapes)]
            # Objects of one checkpoint are written over a few minutes.
            mtimes.append(NOW - timedelta(hours=newest_age_hours, minutes=i * 7 % 30))
            listing.append(ListedObject(key, size, mtimes[-1], cls))
        return max(mtimes)

    for parent in draw(_PARENTS):
        for pattern in draw(_PATTERNS):
            for step in draw(_STEPS):
                name = pattern.replace("{step}", str(step))
                path = f"{parent}/{name}" if parent else name
                age_hours = draw(_AGE_HOURS)
                if pattern == FILE_PATTERN:
                    complete, keys = True, [path]
                else:
                    complete, shards, placeholder, markers = draw(_DIR_SHAPE)
                    keys = [f"{path}/{s}" for s in shards]
                    if placeholder:
                        keys.append(path + "/")  # directory placeholder object
                    if complete:
                        keys += [f"{path}/{m}" for m in markers]
                        # A marker vouches for its own directory only (the drain's order): one
                        # in x/ alone does not complete a checkpoint whose shards are elsewhere.
                        complete = any("/" not in m for m in markers)
                newest = add(keys, age_hours)
                truth.append(TrueCheckpoint((parent, pattern), path, step, complete, keys, newest))
    for key in draw(_UNMANAGED):
        add([key], 1)

    rules = draw(rules_strategy())
    paths = [t.path for t in truth]
    keys = [k for t in truth for k in t.keys]
    pins: set[str] = set()
    pending: set[str] = set()
    if paths:
        pins |= {paths[i % len(paths)] for i in draw(_INDICES)}
        pending |= {keys[i % len(keys)] for i in draw(_INDICES)}
        # Raw prefixes, and keys not yet in the bucket but inside a checkpoint.
        pending |= {paths[i % len(paths)][:-1] for i in draw(_INDICES)[:1]}
        pending |= {paths[i % len(paths)] + "/not-uploaded-yet" for i in draw(_INDICES)[:1]}
    pins |= set(draw(_DIRECTORY_PIN))
    return Scenario(listing, truth, rules, pins, pending)


def pending_touches(prefix: str, truth: TrueCheckpoint) -> bool:
    """Independent restatement of the pending rule: a raw key prefix overlapping
    any key of the checkpoint, or a key inside its directory."""
    return any(k.startswith(prefix) for k in truth.keys) or prefix.startswith(truth.path + "/") or prefix == truth.path


def pin_covers(pin: str, path: str) -> bool:
    return pin == path or path.startswith(pin + "/") or pin.startswith(path + "/")


PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- invariants


@PROPERTY_SETTINGS
@given(scenarios())
def test_planner_invariants(sc: Scenario):
    result = plan(sc.listing, sc.rules, sc.pins, NOW, frozenset(sc.pending))
    entries = {e.path: e for e in result.checkpoints}
    assert sorted(entries) == sorted(t.path for t in sc.truth), "one entry per checkpoint"
    sizes = {o.key: o.size for o in sc.listing}
    classes = {o.key: o.storage_class for o in sc.listing}

    def untouched(path: str) -> bool:
        e = entries[path]
        return e.action == KEEP and not e.delete_keys and not e.transition_objects

    series: dict[tuple[str, str], list[TrueCheckpoint]] = {}
    for t in sc.truth:
        series.setdefault(t.series, []).append(t)

    for members in series.values():
        complete = sorted((t for t in members if t.complete), key=lambda t: t.step)
        newest_complete = complete[-1] if complete else None
        # The newest complete checkpoint of each series is never deleted or tiered.
        if newest_complete:
            assert untouched(newest_complete.path)
        for t in members:
            if t.complete:
                continue
            if newest_complete is None or t.step > newest_complete.step:
                # Possibly in flight: never touched.
                assert untouched(t.path)
                assert "incomplete-newest" in entries[t.path].reasons
            elif (
                sc.rules.incomplete_grace_hours is not None
                and not any(pin_covers(p, t.path) for p in sc.pins)
                and not any(pending_touches(p, t) for p in sc.pending)
            ):
                idle_hours = (NOW - t.newest).total_seconds() / 3600
                expected = DELETE if idle_hours > sc.rules.incomplete_grace_hours else KEEP
                assert entries[t.path].action == expected
            else:
                assert entries[t.path].action == KEEP
            # Incomplete checkpoints are never tiered.
            assert entries[t.path].action != TRANSITION
        # At least min(keep_latest, #complete) complete checkpoints remain.
        remaining = [t for t in complete if entries[t.path].action != DELETE]
        assert len(remaining) >= min(max(sc.rules.keep_latest or 0, 1), len(complete))

    for t in sc.truth:
        e = entries[t.path]
        # Nothing pending in the local cache is deleted or tiered.
        if any(pending_touches(p, t) for p in sc.pending):
            assert untouched(t.path)
            assert "pending-upload" in e.reasons
        # Promoted checkpoints are never deleted or tiered.
        if any(pin_covers(p, t.path) for p in sc.pins):
            assert untouched(t.path)
            assert "promoted" in e.reasons
        # Work lists match the action and stay inside the checkpoint.
        if e.action == DELETE:
            assert sorted(e.delete_keys) == sorted(t.keys)
            assert not e.transition_objects and e.target_class is None
        elif e.action == TRANSITION:
            assert e.transition_objects and e.target_class and not e.delete_batches
            assert set(e.transition_keys) <= set(t.keys)
        else:
            assert not e.delete_batches and not e.transition_objects and e.target_class is None
        for o in e.transition_objects:
            # Objects smaller than the minimum transition size are never transitioned,
            assert sizes[o.key] >= sc.rules.min_transition_bytes
            # ... nor objects already there, archived, or colder than the target.
            assert classes[o.key] != e.target_class
            assert classes[o.key] not in ARCHIVE_CLASSES
            assert COLDNESS.get(classes[o.key], -1) < COLDNESS.get(e.target_class, 99)
            # ... nor objects further along the configured tiers (no moving back).
            later = [t.storage_class for t in sc.rules.tiers]
            assert classes[o.key] not in later[later.index(e.target_class) :]
        # Safe delete order: the markers go first, in a batch of their own.
        if e.action == DELETE and e.kind == "directory" and e.complete:
            first, *rest = e.delete_batches
            assert first and all(any(fnmatchcase(k.rsplit("/", 1)[-1], m) for m in MARKERS) for k in first)
            assert not any(any(fnmatchcase(k.rsplit("/", 1)[-1], m) for m in MARKERS) for b in rest for k in b)

    # The summary accounts for every byte.
    s = result.summary
    total = sum(o.size for o in sc.listing)
    assert sum(s.bytes_before.values()) == total
    assert sum(s.bytes_after.values()) == total - s.bytes_deleted
    assert s.kept + s.transitioned + s.deleted == len(sc.truth)

    # Output forms never break.
    json.dumps(plan_to_json(result, include_keys=True))
    json.dumps(summary_to_json(result))
    assert all(len(line) <= 80 for line in render_table(result).splitlines())


@PROPERTY_SETTINGS
@given(scenarios())
def test_applying_a_plan_then_planning_again_changes_nothing(sc: Scenario):
    first = plan(sc.listing, sc.rules, sc.pins, NOW, frozenset(sc.pending))
    after = apply_plan(sc.listing, first)
    second = plan(after, sc.rules, sc.pins, NOW, frozenset(sc.pending))
    assert [e for e in second.checkpoints if e.action != KEEP] == []
    # Everything the first plan kept is still there and kept for the same reasons.
    kept_first = {e.path: e.reasons for e in first.checkpoints if e.action != DELETE}
    kept_second = {e.path for e in second.checkpoints}
    assert set(kept_first) == kept_second
    for e in second.checkpoints:
        retention = {"latest", "milestone", "geometric", "promoted", "pending-upload"}
        assert retention & set(e.reasons) == retention & set(kept_first[e.path])


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.integers(0, 10**6), min_size=1, max_size=30, unique=True),
    keep_latest=st.none() | st.integers(0, 6),
    pending=st.lists(st.integers(0, 29), max_size=3),
)
def test_keep_latest_floor_with_aggressive_expiry(steps, keep_latest, pending):
    # Everything old, expiry 0: only keep_latest (and pending) can save a checkpoint.
    listing = [ListedObject(f"ckpt-{s}.pt", 10, NOW - timedelta(days=1000)) for s in steps]
    pending_keys = frozenset(f"ckpt-{steps[i]}.pt" for i in pending if i < len(steps))
    result = plan(
        listing,
        LifecycleRules(checkpoints=(FILE_PATTERN,), keep_latest=keep_latest, expire_after_days=0),
        set(),
        NOW,
        pending_keys,
    )
    newest = sorted(steps)[-max(keep_latest or 0, 1) :]
    for e in result.checkpoints:
        expected = KEEP if e.step in newest or e.path in pending_keys else DELETE
        assert e.action == expected, (e.step, e.reasons)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.integers(0, 10**6), min_size=1, max_size=30, unique=True),
    ratio=st.sampled_from([2, 3, 1.5, 1.1, 10]),
)
def test_geometric_matches_brute_force(steps, ratio):
    listing = [ListedObject(f"ckpt-{s}.pt", 10, NOW) for s in steps]
    result = plan(listing, LifecycleRules(checkpoints=(FILE_PATTERN,), keep_geometric=ratio), set(), NOW)
    got = {e.step for e in result.checkpoints if "geometric" in e.reasons}
    ordered = sorted(steps)
    expected = set()
    if ordered[0] == 0:
        expected.add(0)
        ordered = ordered[1:]
    if ordered:
        s0 = ordered[0]
        k = 0
        while s0 * ratio**k <= ordered[-1]:
            expected.add(next(s for s in ordered if s >= s0 * ratio**k))
            k += 1
    assert got == expected


# --------------------------------------------------------------------------- worked examples


def ckpt_dir(path: str, age_days: float, *, complete: bool = True, size: int = 1 << 30, cls: str = "STANDARD"):
    mtime = NOW - timedelta(days=age_days)
    objs = [ListedObject(f"{path}/model.safetensors", size, mtime, cls)]
    if complete:
        objs.append(ListedObject(f"{path}/.metadata", 2000, mtime, cls))
    return objs


def run(steps_ages, *, rules: LifecycleRules, pins=(), pending=(), incomplete=()) -> Plan:
    listing = []
    for step, age in steps_ages:
        listing += ckpt_dir(f"run1/step_{step}", age, complete=step not in incomplete)
    return plan(listing, rules, set(pins), NOW, frozenset(pending))


def actions(p: Plan) -> dict[int, str]:
    return {e.step: e.action for e in p.checkpoints}


def base_rules(**kw) -> LifecycleRules:
    return LifecycleRules(checkpoints=(DIR_PATTERN, FILE_PATTERN), markers=MARKERS, **kw)


def test_geometric_thinning_example():
    # Steps 100..1600 every 100: s0 = 100, keep first at/after 100, 200, 400, 800, 1600.
    steps = [(s, 100 - s / 100) for s in range(100, 1700, 100)]
    p = run(steps, rules=base_rules(keep_geometric=2, keep_latest=1, expire_after_days=30))
    kept = sorted(s for s, a in actions(p).items() if a == KEEP)
    assert kept == [100, 200, 400, 800, 1600]
    assert {e.step for e in p.checkpoints if "geometric" in e.reasons} == {100, 200, 400, 800, 1600}


def test_geometric_thinning_with_gaps_keeps_first_at_or_after():
    steps = [(s, 50) for s in (100, 150, 350, 500, 1000, 3000)]
    p = run(steps, rules=base_rules(keep_geometric=2, expire_after_days=1))
    # thresholds 100, 200, 400, 800, 1600 -> 100, 350, 500, 1000, 3000 (3000 also latest)
    assert sorted(s for s, a in actions(p).items() if a == KEEP) == [100, 350, 500, 1000, 3000]


def test_milestones_are_kept_and_tiered_others_expire():
    steps = [(s, 40 - s / 1000) for s in range(1000, 31000, 1000)]
    rules = base_rules(keep_every_steps=10000, keep_latest=2, expire_after_days=14, tiers=(Tier(7, "GLACIER_IR"),))
    p = run(steps, rules=rules)
    by_step = {e.step: e for e in p.checkpoints}
    for s in (10000, 20000):
        assert by_step[s].action == TRANSITION and by_step[s].target_class == "GLACIER_IR"
        assert by_step[s].reasons == ("milestone", "tier:GLACIER_IR after 7d")
        # The 2000-byte marker stays: below the 128 KiB transition minimum.
        assert by_step[s].transition_keys == (f"run1/step_{s}/model.safetensors",)
    assert by_step[30000].action == KEEP and "milestone" in by_step[30000].reasons  # also latest: not tiered
    assert by_step[29000].reasons == ("latest",)
    assert by_step[5000].action == DELETE and by_step[5000].reasons == ("expired",)


def test_keep_latest_keeps_newest_in_their_class_even_when_old():
    p = run(
        [(s, 100) for s in (1, 2, 3, 4)],
        rules=base_rules(keep_latest=2, expire_after_days=1, tiers=(Tier(1, "GLACIER_IR"),)),
    )
    assert actions(p) == {1: DELETE, 2: DELETE, 3: KEEP, 4: KEEP}
    assert p.checkpoints[2].reasons == ("latest",)


def test_newest_complete_is_kept_even_with_keep_latest_zero():
    p = run([(1, 100), (2, 100)], rules=base_rules(keep_latest=0, expire_after_days=1))
    assert actions(p) == {1: DELETE, 2: KEEP}


def test_absent_rules_do_nothing():
    p = run([(s, 400) for s in range(1, 6)], rules=base_rules(), incomplete={2})
    assert set(actions(p).values()) == {KEEP}
    assert p.checkpoints[0].reasons == ("no-expiry-rule",)
    assert p.checkpoints[1].reasons == ("incomplete-no-grace-rule",)


def test_incomplete_checkpoints():
    rules = base_rules(incomplete_grace_hours=24, expire_after_days=365)
    p = run([(1, 10), (2, 0.5), (3, 5), (4, 3), (5, 0.01)], rules=rules, incomplete={1, 2, 4, 5})
    by_step = {e.step: e for e in p.checkpoints}
    assert by_step[1].action == DELETE and by_step[1].reasons == ("incomplete-stale",)
    assert by_step[2].action == KEEP and by_step[2].reasons == ("incomplete-within-grace",)
    assert by_step[4].action == KEEP and by_step[4].reasons == ("incomplete-newest",)  # newer than step 3
    assert by_step[5].reasons == ("incomplete-newest",)
    # No marker: a single batch holding every object.
    assert by_step[1].delete_batches == (("run1/step_1/model.safetensors",),)


def test_series_without_complete_checkpoint_is_left_alone_with_a_warning():
    p = run([(1, 100), (2, 90)], rules=base_rules(incomplete_grace_hours=1, expire_after_days=1), incomplete={1, 2})
    assert set(actions(p).values()) == {KEEP}
    assert any("run1/step_{step}: no complete checkpoint" in w for w in p.warnings)


def test_without_markers_directory_checkpoints_are_never_complete():
    listing = ckpt_dir("run1/step_1", 100) + ckpt_dir("run1/step_2", 100)
    p = plan(
        listing, LifecycleRules(checkpoints=(DIR_PATTERN,), expire_after_days=1, incomplete_grace_hours=1), set(), NOW
    )
    assert set(actions(p).values()) == {KEEP}
    assert any("lifecycle.markers is empty" in w for w in p.warnings)


def test_delete_order_puts_markers_first_and_placeholders_last():
    mtime = NOW - timedelta(days=100)
    listing = [
        ListedObject("step_1/", 0, mtime),
        ListedObject("step_1/a/", 0, mtime),
        ListedObject("step_1/a/shard", 10, mtime),
        ListedObject("step_1/.metadata", 10, mtime),
        ListedObject("step_1/b/COMPLETE", 10, mtime),
        ListedObject("step_1/z", 10, mtime),
    ] + ckpt_dir("step_2", 1)
    p = plan(listing, base_rules(expire_after_days=30), set(), NOW)
    entry = p.checkpoints[0]
    assert entry.action == DELETE
    assert entry.delete_batches == (
        ("step_1/.metadata", "step_1/b/COMPLETE"),
        ("step_1/a/shard", "step_1/z", "step_1/a/", "step_1/"),
    )


def test_file_checkpoint_delete():
    listing = [ListedObject("ckpt-1.pt", 10, NOW - timedelta(days=9)), ListedObject("ckpt-2.pt", 10, NOW)]
    p = plan(listing, base_rules(expire_after_days=5), set(), NOW)
    assert p.checkpoints[0].delete_batches == (("ckpt-1.pt",),)


def test_pins_cover_checkpoints_directories_and_keys_inside():
    rules = base_rules(expire_after_days=1)
    listing = []
    for run_name in ("run1", "run2"):
        for step in (1, 2, 3):
            listing += ckpt_dir(f"{run_name}/step_{step}", 100 - step)
    p = plan(listing, rules, {"run1/", "run2/step_1/model.safetensors", "gone/step_9"}, NOW)
    got = {e.path: e.action for e in p.checkpoints}
    assert got == {
        "run1/step_1": KEEP,
        "run1/step_2": KEEP,
        "run1/step_3": KEEP,
        "run2/step_1": KEEP,
        "run2/step_2": DELETE,
        "run2/step_3": KEEP,
    }
    assert p.warnings == ("pin 'gone/step_9' matches no checkpoint in the listing",)


def test_pending_key_prefixes_protect_conservatively():
    rules = base_rules(expire_after_days=1)
    listing = []
    for step in (1, 10, 20, 30):
        listing += ckpt_dir(f"run1/step_{step}", 100 - step)
    # "run1/step_1" is a raw prefix of step_1 and step_10; step_20 has an
    # upload in progress for a key not yet in the bucket.
    p = plan(listing, rules, set(), NOW, frozenset({"run1/step_1", "run1/step_20/optim/3"}))
    assert actions(p) == {1: KEEP, 10: KEEP, 20: KEEP, 30: KEEP}
    assert all(e.reasons[0] == "pending-upload" for e in p.checkpoints[:3])


def test_tiering_respects_minimum_size_and_class_order():
    mtime = NOW - timedelta(days=50)
    listing = [
        ListedObject("step_1/big", 1 << 20, mtime, "STANDARD"),
        ListedObject("step_1/small", 1000, mtime, "STANDARD"),
        ListedObject("step_1/already", 1 << 20, mtime, "DEEP_ARCHIVE"),
        ListedObject("step_1/.metadata", 1000, mtime),
        ListedObject("step_2/only-small", 1000, mtime),
        ListedObject("step_2/.metadata", 1000, mtime),
    ] + ckpt_dir("step_3", 0)
    rules = base_rules(tiers=(Tier(7, "STANDARD_IA"), Tier(30, "GLACIER_IR")))
    p = plan(listing, rules, set(), NOW)
    one, two, _ = p.checkpoints
    assert one.storage_class == "mixed"
    assert (one.action, one.target_class, one.transition_keys) == (TRANSITION, "GLACIER_IR", ("step_1/big",))
    assert one.reasons == ("no-expiry-rule", "tier:GLACIER_IR after 30d")
    assert (two.action, two.reasons) == (KEEP, ("no-expiry-rule", "below-min-transition-size"))


def test_archived_objects_are_not_transitioned():
    mtime = NOW - timedelta(days=50)
    listing = [
        ListedObject("step_1/big", 1 << 20, mtime, "GLACIER"),
        ListedObject("step_1/.metadata", 1 << 20, mtime, "GLACIER"),
    ]
    listing += ckpt_dir("step_2", 0)
    p = plan(listing, base_rules(tiers=(Tier(30, "DEEP_ARCHIVE"),)), set(), NOW)
    assert p.checkpoints[0].action == KEEP
    assert "archived-not-transitioned" in p.checkpoints[0].reasons


def test_custom_classes_follow_the_configured_progression():
    mtime = NOW - timedelta(days=50)
    listing = [
        ListedObject("step_1/a", 1 << 20, mtime, "WARM_HDD"),
        ListedObject("step_1/b", 1 << 20, mtime, "STANDARD"),
        ListedObject("step_1/.metadata", 1 << 20, mtime, "COLD_TAPE"),
    ] + ckpt_dir("step_2", 0)
    rules = base_rules(tiers=(Tier(1, "WARM_HDD"), Tier(10, "COLD_TAPE")))
    entry = plan(listing, rules, set(), NOW).checkpoints[0]
    assert entry.target_class == "COLD_TAPE"
    assert set(entry.transition_keys) == {"step_1/a", "step_1/b"}
    # Never back along the progression: at age 5 the target is WARM_HDD and
    # the COLD_TAPE marker stays where it is.
    younger = [replace(o, last_modified=NOW - timedelta(days=5)) for o in listing]
    entry = plan(younger, rules, set(), NOW).checkpoints[0]
    assert (entry.target_class, entry.transition_keys) == ("WARM_HDD", ("step_1/b",))


def test_summary_bytes_and_costs():
    gib = 1 << 30
    mtime = NOW - timedelta(days=50)
    listing = [
        ListedObject("step_1/model", 10 * gib, mtime),
        ListedObject("step_1/.metadata", 0, mtime),
        ListedObject("step_2/model", 10 * gib, mtime),
        ListedObject("step_2/.metadata", 0, mtime),
        ListedObject("step_3/model", 10 * gib, NOW),
        ListedObject("step_3/.metadata", 0, NOW),
        ListedObject("notes", 5 * gib, NOW, "ONEZONE_IA"),
    ]
    rules = base_rules(
        keep_every_steps=2,
        expire_after_days=30,
        tiers=(Tier(7, "GLACIER_IR"),),
        prices={"STANDARD": 0.023, "GLACIER_IR": 0.004},
    )
    p = plan(listing, rules, set(), NOW)
    s = p.summary
    assert dict(s.bytes_before) == {"STANDARD": 30 * gib, "ONEZONE_IA": 5 * gib, "GLACIER_IR": 0}
    assert dict(s.bytes_after) == {"STANDARD": 10 * gib, "ONEZONE_IA": 5 * gib, "GLACIER_IR": 10 * gib}
    assert s.cost_before == 30 * 0.023
    assert abs(s.cost_after - (10 * 0.023 + 10 * 0.004)) < 1e-9
    assert s.unpriced_classes == ("ONEZONE_IA",)
    assert (s.kept, s.transitioned, s.deleted) == (1, 1, 1)
    assert (s.bytes_deleted, s.objects_deleted, s.bytes_transitioned) == (10 * gib, 2, 10 * gib)
    assert (s.unmanaged_objects, s.unmanaged_bytes) == (1, 5 * gib)


def test_boundaries_expiry_is_inclusive_grace_is_strict():
    listing = ckpt_dir("step_1", 14) + ckpt_dir("step_2", 1, complete=False) + ckpt_dir("step_3", 0)
    listing += ckpt_dir("step_0", 30, complete=False)
    p = plan(listing, base_rules(expire_after_days=14, incomplete_grace_hours=24), set(), NOW)
    assert actions(p) == {0: DELETE, 1: DELETE, 2: KEEP, 3: KEEP}


def test_plan_is_deterministic_and_needs_aware_now():
    listing = ckpt_dir("step_1", 3) + ckpt_dir("step_2", 1)
    rules = base_rules(expire_after_days=2)
    assert plan(listing, rules, set(), NOW) == plan(list(reversed(listing)), rules, set(), NOW)
    try:
        plan(listing, rules, set(), NOW.replace(tzinfo=None))
    except ValueError as exc:
        assert "timezone-aware" in str(exc)
    else:
        raise AssertionError("naive now accepted")
