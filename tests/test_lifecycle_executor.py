"""lifecycle.executor against the file:// store: delete order, idempotence, direct
transitions, bucket-lifecycle mode (with an in-memory lifecycle configuration),
pins, pending keys of a local cache, re-checks before executing."""

from __future__ import annotations

import copy
import os
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import trio

sys.path.insert(0, os.path.dirname(__file__))

from ckptfs.drain.store import NotSupportedError, StoreError  # noqa: E402
from ckptfs.drain.factory import open_store
from ckptfs.lifecycle.catalog import MTIME_TAG  # noqa: E402
from ckptfs.lifecycle.executor import (  # noqa: E402
    TIER_TAG,
    desired_bucket_rules,
    execute,
    gather_inputs,
    key_mapper,
    list_bucket,
    normalize_rule,
    read_local_pending,
    rule_id_base,
    run_once,
    sync_bucket_lifecycle,
)
from ckptfs.lifecycle.pins import PIN_PREFIX, add_pin, is_reserved_key, pin_key, read_pins, remove_pin  # noqa: E402
from ckptfs.lifecycle.planner import DELETE, KEEP, TRANSITION  # noqa: E402
from ckptfs.lifecycle.rules import LifecycleRules, Tier  # noqa: E402

NOW = datetime.now(timezone.utc).replace(microsecond=0)
DAY = 86400
SHARD = 200_000  # above the default min_transition_bytes (128 KiB)

RULES = LifecycleRules(
    checkpoints=("step_{step}",),
    markers=(".metadata",),
    keep_latest=1,
    keep_every_steps=200,
    expire_after_days=7,
    tiers=(Tier(3, "COLD"),),
)


class Recorder:
    """Delegates to a real store and records every call (start/end, in order).

    ``lifecycle``: None = the store has no bucket lifecycle (as file://), else
    a list standing in for the bucket's lifecycle configuration.
    """

    RECORDED = ("head", "list", "copy", "delete", "delete_many", "get_tags", "put_tags", "put_object",
                "get_bucket_lifecycle", "put_bucket_lifecycle")
    MUTATING = ("copy", "delete", "delete_many", "put_tags", "put_object", "put_bucket_lifecycle")

    def __init__(self, inner, *, lifecycle: list | None = None, prefix: str = ""):
        self.inner = inner
        self.url = inner.url
        self.prefix = prefix
        self.lifecycle = lifecycle
        self.events: list[tuple[str, str, tuple]] = []
        self.fail: dict = {}  # op -> fn(args) -> exception or None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    def _wrap(self, name, fn):
        async def call(*args, **kw):
            self.events.append(("start", name, args))
            try:
                check = self.fail.get(name)
                if check is not None:
                    exc = check(args)
                    if exc is not None:
                        raise exc
                return await fn(*args, **kw)
            finally:
                self.events.append(("end", name, args))

        return call

    def __getattribute__(self, name):
        if name in Recorder.RECORDED:
            if name == "get_bucket_lifecycle":
                fn = self._get_lc
            elif name == "put_bucket_lifecycle":
                fn = self._put_lc
            else:
                fn = getattr(object.__getattribute__(self, "inner"), name)
            return object.__getattribute__(self, "_wrap")(name, fn)
        return object.__getattribute__(self, name)

    async def _get_lc(self):
        if self.lifecycle is None:
            raise NotSupportedError("no lifecycle here")
        return copy.deepcopy(self.lifecycle)

    async def _put_lc(self, rules):
        if self.lifecycle is None:
            raise NotSupportedError("no lifecycle here")
        self.lifecycle[:] = copy.deepcopy(list(rules))

    def calls(self, name: str) -> list[tuple]:
        return [args for phase, op, args in self.events if phase == "start" and op == name]

    def mutations(self) -> list[tuple[str, tuple]]:
        return [(op, args) for phase, op, args in self.events if phase == "start" and op in self.MUTATING]


def run(fn, *args):
    return trio.run(fn, *args)


def put(store, key: str, data: bytes, age_days: float, metadata=None) -> None:
    async def go():
        await store.put_object(key, data, metadata)

    trio.run(go)
    t = (NOW - timedelta(days=age_days)).timestamp()
    os.utime(os.path.join(store.root, *key.rstrip("/").split("/")), (t, t))


def make_checkpoints(store, steps_ages, *, parent="run1", shards=2, marker=True) -> None:
    for step, age in steps_ages:
        for i in range(shards):
            put(store, f"{parent}/step_{step}/shard{i}", os.urandom(SHARD), age,
                {"blake3": f"b{step}{i}", "mode": "33188", "mtime": "1700000000.000000000"})
        if marker:
            put(store, f"{parent}/step_{step}/.metadata", b"meta", age)


@pytest.fixture
def bucket(tmp_path) -> Path:
    root = tmp_path / "bucket"
    root.mkdir()
    return root


@pytest.fixture
def store(bucket):
    return open_store(f"file://{bucket}")


def standard_bucket(store) -> None:
    # 100: expired; 200: milestone, tiered; 300: within expiry, tiered; 400 milestone tiered; 500: latest
    make_checkpoints(store, [(100, 10), (200, 8), (300, 6), (400, 4), (500, 2)])


async def plan_and_execute(store, rules=RULES, now=NOW, **kw):
    pending = kw.pop("pending", None)
    inputs = await gather_inputs(store, rules, now, pending=pending)
    report = await execute(store, rules, inputs, pending=pending, **kw)
    return inputs, report


# --------------------------------------------------------------------------- deletes


def test_deletes_run_batch_by_batch_markers_first(store):
    standard_bucket(store)
    rec = Recorder(store)
    inputs, report = run(plan_and_execute, rec)
    entry = next(e for e in inputs.plan.checkpoints if e.path == "run1/step_100")
    assert entry.action == DELETE
    assert entry.delete_batches[0] == ("run1/step_100/.metadata",)
    # the store saw exactly the plan's batches, in order, each finished before the next started
    deletes = [(phase, args[0]) for phase, op, args in rec.events if op == "delete_many"]
    assert deletes == [
        ("start", ("run1/step_100/.metadata",)),
        ("end", ("run1/step_100/.metadata",)),
        ("start", ("run1/step_100/shard0", "run1/step_100/shard1")),
        ("end", ("run1/step_100/shard0", "run1/step_100/shard1")),
    ]
    assert report.ok and report.result_for("run1/step_100").deleted == 3
    keys = {o.key for o in run(list_bucket, store)[0]}
    assert not any(k.startswith("run1/step_100/") for k in keys)


def test_failed_marker_batch_stops_that_checkpoint(store):
    standard_bucket(store)
    rec = Recorder(store)
    rec.fail["delete_many"] = lambda args: StoreError("boom", code="InternalError") if ".metadata" in args[0][0] else None
    _, report = run(plan_and_execute, rec)
    result = report.result_for("run1/step_100")
    assert result.status == "failed" and result.deleted == 0
    assert [args[0] for args in rec.calls("delete_many")] == [("run1/step_100/.metadata",)]  # shards untouched
    assert not report.ok
    keys = {o.key for o in run(list_bucket, store)[0]}
    assert {"run1/step_100/.metadata", "run1/step_100/shard0", "run1/step_100/shard1"} <= keys


# --------------------------------------------------------------------------- direct transitions


def test_direct_transition_keeps_data_metadata_tags_and_age(store):
    standard_bucket(store)

    async def add_user_tag():
        await store.put_tags("run1/step_300/shard0", {"team": "vision"})

    run(add_user_tag)
    before = {k: run(store.head, k) for k in ("run1/step_300/shard0", "run1/step_300/shard1")}
    data_before = run(store.get_range, "run1/step_300/shard0", 0, SHARD)
    _, report = run(plan_and_execute, store)  # file:// has no bucket lifecycle: direct
    assert report.mode == "direct" and report.bucket_rules == "not-supported"
    assert report.result_for("run1/step_300").copied == 2
    for key, old in before.items():
        new = run(store.head, key)
        assert new.storage_class == "COLD"
        assert new.metadata == old.metadata  # blake3, mode, mtime survive
        assert new.size == old.size
        tags = run(store.get_tags, key)
        assert tags[TIER_TAG] == "COLD"
        assert datetime.fromisoformat(tags[MTIME_TAG]) == old.last_modified
    assert run(store.get_tags, "run1/step_300/shard0")["team"] == "vision"
    assert run(store.get_range, "run1/step_300/shard0", 0, SHARD) == data_before
    # the small marker stays in STANDARD
    assert run(store.head, "run1/step_300/.metadata").storage_class == "STANDARD"
    # the copy reset LastModified, but the planner reads ckptfs-mtime: the age is unchanged
    again = run(gather_inputs, store, RULES, NOW)
    ages = {e.path: round(e.age_days, 3) for e in again.plan.checkpoints}
    assert ages["run1/step_300"] == 6.0 and ages["run1/step_200"] == 8.0


def test_apply_twice_second_run_changes_nothing(store, caplog):
    standard_bucket(store)
    _, first = run(plan_and_execute, store)
    assert first.changes > 0
    rec = Recorder(store)
    with caplog.at_level("INFO", logger="ckptfs.lifecycle"):
        inputs, second = run(plan_and_execute, rec)
    assert [e for e in inputs.plan.checkpoints if e.action != KEEP] == []
    assert rec.mutations() == []
    assert second.changes == 0 and second.summary_line() == "nothing to do"
    assert any(r.getMessage() == "nothing to do" for r in caplog.records)


def test_direct_copy_is_conditional_on_the_listed_etag(store):
    standard_bucket(store)

    async def go():
        inputs = await gather_inputs(store, RULES, NOW)
        # rewritten after the listing: a blind copy would move the new content
        await store.put_object("run1/step_300/shard0", os.urandom(SHARD))
        return await execute(store, RULES, inputs)

    report = run(go)
    result = report.result_for("run1/step_300")
    assert result.copied == 1 and result.unchanged == 1 and not result.errors
    assert run(store.head, "run1/step_300/shard0").storage_class == "STANDARD"


def test_gone_object_is_skipped_not_failed(store):
    standard_bucket(store)

    async def go():
        inputs = await gather_inputs(store, RULES, NOW)
        await store.delete("run1/step_200/shard1")
        return await execute(store, RULES, inputs, direct=True)

    report = run(go)
    result = report.result_for("run1/step_200")
    assert result.copied == 1 and result.unchanged == 1 and result.status == "done" and report.ok


# --------------------------------------------------------------------------- bucket lifecycle mode


def test_bucket_lifecycle_mode_tags_and_installs_rules_once(store):
    standard_bucket(store)
    foreign = {
        "ID": "user-expire-tmp",
        "Status": "Enabled",
        # radosgw 16.2 reads an And{Prefix, Tag} filter back without the And
        "Filter": {"Prefix": "tmp/", "Tag": {"Key": "scratch", "Value": "yes"}},
        "Expiration": {"Days": 30},
    }
    lifecycle = [foreign]
    rec = Recorder(store, lifecycle=lifecycle, prefix="ckpt/")
    _, report = run(plan_and_execute, rec)
    assert report.mode == "bucket-lifecycle" and report.bucket_rules == "updated" and report.ok
    base = rule_id_base("ckpt/")
    by_id = {r["ID"]: r for r in lifecycle}
    assert set(by_id) == {"user-expire-tmp", f"{base}-tier-COLD", f"{base}-abort-incomplete-uploads"}
    # the foreign rule is kept, in a shape a server accepts back
    assert by_id["user-expire-tmp"]["Filter"] == {
        "And": {"Prefix": "tmp/", "Tags": [{"Key": "scratch", "Value": "yes"}]}}
    assert by_id["user-expire-tmp"]["Expiration"] == {"Days": 30}
    tier = by_id[f"{base}-tier-COLD"]
    assert tier["Filter"] == {"And": {"Prefix": "ckpt/", "Tags": [{"Key": TIER_TAG, "Value": "COLD"}]}}
    assert tier["Transitions"] == [{"Days": 0, "StorageClass": "COLD"}]
    abort = by_id[f"{base}-abort-incomplete-uploads"]
    assert abort["Filter"] == {"Prefix": "ckpt/"}
    assert abort["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] >= 1
    # objects are tagged, not copied: the provider moves them (keeping LastModified)
    assert rec.calls("copy") == []
    for step in (200, 300, 400):
        for i in (0, 1):
            tags = run(store.get_tags, f"run1/step_{step}/shard{i}")
            assert tags[TIER_TAG] == "COLD" and MTIME_TAG in tags
            assert run(store.head, f"run1/step_{step}/shard{i}").storage_class == "STANDARD"
        assert TIER_TAG not in run(store.get_tags, f"run1/step_{step}/.metadata")
    assert TIER_TAG not in run(store.get_tags, "run1/step_500/shard0")

    # Second run: the rules are in place, the objects tagged and waiting: nothing changes.
    rec2 = Recorder(store, lifecycle=lifecycle, prefix="ckpt/")
    _, again = run(plan_and_execute, rec2)
    assert rec2.mutations() == []
    assert again.bucket_rules == "unchanged" and again.changes == 0
    assert again.result_for("run1/step_300").status == "waiting"
    assert again.summary_line().startswith("nothing to do (6 object(s) tagged earlier")


def test_bucket_rules_for_other_prefixes_are_kept_and_stale_ones_removed(store):
    other = desired_bucket_rules("other/", RULES)
    stale = desired_bucket_rules("ckpt/", LifecycleRules(tiers=(Tier(1, "OLDCLASS"),)))
    lifecycle = copy.deepcopy(other + stale)
    rec = Recorder(store, lifecycle=lifecycle, prefix="ckpt/")
    assert run(sync_bucket_lifecycle, rec, RULES) is True
    ids = {r["ID"] for r in lifecycle}
    assert {r["ID"] for r in other} <= ids
    assert f"{rule_id_base('ckpt/')}-tier-OLDCLASS" not in ids
    assert f"{rule_id_base('ckpt/')}-tier-COLD" in ids
    assert run(sync_bucket_lifecycle, rec, RULES) is False  # idempotent


def test_bucket_rule_shapes():
    rules = LifecycleRules(tiers=(Tier(10, "STANDARD_IA"), Tier(40, "GLACIER_IR")))
    got = desired_bucket_rules("", rules)
    ia, gir, abort = got
    assert ia["Filter"] == {"Tag": {"Key": TIER_TAG, "Value": "STANDARD_IA"}}  # no prefix: a plain tag filter
    assert ia["Transitions"] == [{"Days": 30, "StorageClass": "STANDARD_IA"}]  # AWS minimum for IA
    assert gir["Transitions"] == [{"Days": 0, "StorageClass": "GLACIER_IR"}]
    assert abort["Filter"] == {"Prefix": ""}
    assert all(r["ID"].startswith("ckptfs-") for r in got)
    # radosgw's read-back shape and AWS's are the same rule
    rgw = {"ID": "x", "Status": "Enabled", "Filter": {"Prefix": "p/", "Tag": {"Key": "k", "Value": "v"}}}
    assert normalize_rule(rgw)["Filter"] == {"And": {"Prefix": "p/", "Tags": [{"Key": "k", "Value": "v"}]}}
    plain = {"ID": "y", "Status": "Enabled", "Filter": {"Prefix": "p/"}}
    assert normalize_rule(plain) == plain


def test_bucket_rules_failure_skips_tiering_but_not_deletes(store):
    standard_bucket(store)
    rec = Recorder(store, lifecycle=[], prefix="")
    rec.fail["put_bucket_lifecycle"] = lambda args: StoreError("InvalidStorageClass", code="InvalidArgument", status=400)
    _, report = run(plan_and_execute, rec)
    assert report.bucket_rules == "failed" and not report.ok
    assert report.result_for("run1/step_100").deleted == 3
    assert report.result_for("run1/step_300").status == "failed"
    assert rec.calls("put_tags") == [] and rec.calls("copy") == []


def test_direct_flag_copies_even_where_lifecycle_is_supported(store):
    standard_bucket(store)
    lifecycle: list = []
    rec = Recorder(store, lifecycle=lifecycle)
    _, report = run(lambda: plan_and_execute(rec, direct=True))
    assert report.mode == "direct" and report.bucket_rules == "not-used"
    assert lifecycle == [] and rec.calls("get_bucket_lifecycle") == []
    assert run(store.head, "run1/step_300/shard0").storage_class == "COLD"


# --------------------------------------------------------------------------- pins


def test_pins_live_in_the_bucket_and_keep_checkpoints(store):
    standard_bucket(store)
    assert run(add_pin, store, "run1/step_100") is True
    assert run(add_pin, store, "/run1/step_100/") is False  # already there
    assert run(add_pin, store, "run1") is True  # a directory pin next to a checkpoint pin (file:// too)
    assert run(read_pins, store) == ["run1", "run1/step_100"]
    assert run(store.head, pin_key("run1/step_100")) is not None
    listing, pins = run(list_bucket, store)
    assert pins == ["run1", "run1/step_100"]
    assert not any(is_reserved_key(o.key) for o in listing)  # pins never become checkpoints
    assert run(remove_pin, store, "run1") is True
    assert run(remove_pin, store, "run1") is False
    inputs = run(gather_inputs, store, RULES, NOW)
    entry = next(e for e in inputs.plan.checkpoints if e.path == "run1/step_100")
    assert entry.action == KEEP and "promoted" in entry.reasons
    assert all(not e.path.startswith(".ckptfs") for e in inputs.plan.checkpoints)
    _, report = run(plan_and_execute, store)
    assert run(store.head, "run1/step_100/.metadata") is not None
    assert run(store.head, pin_key("run1/step_100")) is not None  # apply never touches pins
    assert report.ok


def test_pin_added_between_plan_and_execute_is_honoured(store):
    standard_bucket(store)

    async def go():
        inputs = await gather_inputs(store, RULES, NOW)
        assert next(e for e in inputs.plan.checkpoints if e.path == "run1/step_100").action == DELETE
        await add_pin(store, "run1/step_100")
        return await execute(store, RULES, inputs)

    report = run(go)
    result = report.result_for("run1/step_100")
    assert result.status == "skipped" and "promoted" in result.detail
    assert run(store.head, "run1/step_100/shard0") is not None


def test_reserved_keys():
    assert is_reserved_key(".ckptfs/pins/a/")
    assert is_reserved_key(".ckptfs-probe/123")
    assert not is_reserved_key("run1/.ckptfs/x") and not is_reserved_key(".ckptfsx/a")
    assert PIN_PREFIX == ".ckptfs/pins/"


# --------------------------------------------------------------------------- pending keys of a local cache


def test_pending_keys_of_a_local_cache_are_not_touched(tmp_path):
    from ckptfs.fsmeta import MetaStore
    from test_drain_support import DrainEnv

    env = DrainEnv(tmp_path)
    store = open_store(f"file://{env.bucket}")
    url = f"file://{env.bucket}"
    try:
        standard_bucket(store)
        # step_100 is being (re)written through the mount: a pending file inside it
        env.write_file("run1/step_100/late_shard", b"x" * 1000)
        dirs = [env.ino("run1"), env.ino("run1/step_100")]
    finally:
        env.close()  # one LMDB environment per process: the reader opens its own
    # new local directories are pending too (until the drain reconciles them),
    # and a pending directory covers everything below it
    assert read_local_pending(str(env.cache), url) == {"run1/", "run1/step_100/", "run1/step_100/late_shard"}
    meta = MetaStore(str(env.cache / "meta"), create=False)
    try:
        meta.write(lambda txn: [txn.clear_pending(ino) for ino in dirs])  # as the drain would
    finally:
        meta.close()
    assert read_local_pending(str(env.cache), url) == {"run1/step_100/late_shard"}

    inputs, report = run(lambda: plan_and_execute(store, pending=lambda: read_local_pending(str(env.cache), url)))
    entry = next(e for e in inputs.plan.checkpoints if e.path == "run1/step_100")
    assert entry.action == KEEP and "pending-upload" in entry.reasons
    assert run(store.head, "run1/step_100/.metadata") is not None
    assert report.result_for("run1/step_100") is None
    assert report.result_for("run1/step_300").status == "done"


def test_key_that_becomes_pending_before_execution_is_skipped(store):
    standard_bucket(store)
    calls = {"n": 0}

    def pending():
        calls["n"] += 1
        return [] if calls["n"] == 1 else ["run1/step_100/new_file"]

    _, report = run(lambda: plan_and_execute(store, pending=pending))
    assert report.result_for("run1/step_100").status == "skipped"
    assert run(store.head, "run1/step_100/.metadata") is not None
    assert report.result_for("run1/step_300").status == "done"


def test_key_mapper_between_cache_and_store_prefixes():
    same = key_mapper("s3://bkt/ckpt", "s3://bkt/ckpt/")
    assert same("run1/x") == "run1/x"
    deeper_cache = key_mapper("s3://bkt/ckpt/run1", "s3://bkt/ckpt")
    assert deeper_cache("step_1/x") == "run1/step_1/x"
    deeper_store = key_mapper("s3://bkt/ckpt", "s3://bkt/ckpt/run1")
    assert deeper_store("run1/step_1/x") == "step_1/x"
    assert deeper_store("run2/step_1/x") is None
    assert deeper_store("run1/") == ""  # a pending dir above the store covers all of it
    assert key_mapper("s3://other/ckpt", "s3://bkt/ckpt") is None
    assert key_mapper("s3://bkt/a", "s3://bkt/b") is None
    assert key_mapper("file:///data/x", "s3://bkt/x") is None
    assert key_mapper("file:///data/x/run1", "file:///data/x")("s") == "run1/s"


def test_cache_of_another_bucket_is_refused(tmp_path):
    from ckptfs.lifecycle.executor import CacheMismatch
    from test_drain_support import DrainEnv

    env = DrainEnv(tmp_path)
    env.close()
    with pytest.raises(CacheMismatch):
        read_local_pending(str(env.cache), "s3://somewhere-else/p")


# --------------------------------------------------------------------------- misc


def test_plan_only_run_changes_nothing(store):
    standard_bucket(store)
    rec = Recorder(store)
    inputs, report = run(lambda: run_once(rec, RULES, NOW, apply=False))
    assert report is None and rec.mutations() == []
    assert {e.action for e in inputs.plan.checkpoints} == {KEEP, DELETE, TRANSITION}


def test_incomplete_and_unmanaged_objects_are_left_alone(store):
    standard_bucket(store)
    make_checkpoints(store, [(50, 30)], marker=False)  # old, incomplete, no grace rule
    put(store, "notes/readme.txt", b"hi", 100)
    _, report = run(plan_and_execute, store)
    assert report.ok
    assert run(store.head, "run1/step_50/shard0") is not None
    assert run(store.head, "notes/readme.txt") is not None


def test_bucket_rules_failure_without_tiering_is_only_a_warning(store):
    make_checkpoints(store, [(100, 10), (200, 1)])
    rules = LifecycleRules(checkpoints=("step_{step}",), markers=(".metadata",), expire_after_days=7)
    rec = Recorder(store, lifecycle=[], prefix="")
    rec.fail["get_bucket_lifecycle"] = lambda args: StoreError("denied", code="AccessDenied", status=403)
    _, report = run(lambda: plan_and_execute(rec, rules=rules))
    assert report.bucket_rules == "failed" and report.ok  # deletes done; no tiering needed
    assert report.result_for("run1/step_100").deleted == 3


def test_directory_placeholders_are_not_moved(store):
    make_checkpoints(store, [(100, 5), (200, 1)])
    put(store, "run1/step_100/", b"", 5)  # a "dir/" placeholder object
    rules = LifecycleRules(checkpoints=("step_{step}",), markers=(".metadata",), tiers=(Tier(3, "COLD"),),
                           min_transition_bytes=0)
    inputs, report = run(lambda: plan_and_execute(store, rules=rules))
    entry = next(e for e in inputs.plan.checkpoints if e.path == "run1/step_100")
    assert "run1/step_100/" not in entry.transition_keys  # a dir/ marker holds no data: never planned
    assert report.ok and report.result_for("run1/step_100").copied == 3  # 2 shards + the marker file
    assert run(store.head, "run1/step_100/shard0").storage_class == "COLD"


def test_a_checkpoint_another_node_still_writes_is_never_deleted_nor_the_last_complete_one(store):
    """The issue's case: node A's marker is out, node B still holds a shard. With cluster
    commit A's marker is held, so the new checkpoint is incomplete in the bucket, and B's
    in-flight record keeps it from being deleted as incomplete, however old."""
    make_checkpoints(store, [(100, 10)])
    make_checkpoints(store, [(200, 9)], marker=False)  # B's shard still on B: marker held on A
    put(store, ".ckptfs-inflight/run1/step_200/.ckptfs-node-00000000000000bb-0000abcd-3", b"{}", 9)
    rules = LifecycleRules(checkpoints=("step_{step}",), markers=(".metadata",), keep_latest=1,
                           expire_after_days=1, incomplete_grace_hours=1)
    inputs, report = run(lambda: plan_and_execute(store, rules=rules))
    entries = {e.path: e for e in inputs.plan.checkpoints}
    assert entries["run1/step_100"].action == KEEP  # the newest complete one
    assert entries["run1/step_200"].action == KEEP and "pending-upload" in entries["run1/step_200"].reasons
    assert run(store.head, "run1/step_200/shard0") is not None
    assert report.ok
    # Once B's record is gone, nothing in flight protects it any more.
    os.unlink(os.path.join(store.root, ".ckptfs-inflight/run1/step_200/.ckptfs-node-00000000000000bb-0000abcd-3"))
    inputs = run(gather_inputs, store, rules, NOW)
    assert "pending-upload" not in {e.path: e for e in inputs.plan.checkpoints}["run1/step_200"].reasons
