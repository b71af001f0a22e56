"""Grouping a bucket listing into checkpoint series."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pytest

from ckptfs.lifecycle.catalog import MTIME_TAG, ListedObject, build_catalog
from ckptfs.lifecycle.patterns import compile_step_pattern, match_step
from ckptfs.lifecycle.rules import LifecycleRules

NOW = datetime(2025, 6, 1, tzinfo=timezone.utc)
RULES = LifecycleRules(checkpoints=("step_{step}", "ckpt-{step}.pt", "*-{step}"), markers=(".metadata", "*COMPLETE*"))


def obj(key, size=1000, age_days=1.0, storage_class="STANDARD", tags=None):
    return ListedObject(key, size, NOW - timedelta(days=age_days), storage_class, tags)


@pytest.mark.parametrize(
    "pattern, name, step",
    [
        ("step_{step}", "step_1000", 1000),
        ("step_{step}", "step_00100", 100),
        ("step_{step}", "step_", None),
        ("step_{step}", "step_10x", None),
        ("step_{step}", "xstep_10", None),
        ("ckpt-{step}.pt", "ckpt-5.pt", 5),
        ("ckpt-{step}.pt", "ckpt-5xpt", None),  # '.' is literal, not a regex dot
        ("*{step}", "abc123", 123),  # '*' is lazy: the step takes all digits
        ("*-{step}", "epoch=3-step=7-42", 42),
        ("ep?_{step}", "ep1_7", 7),
        ("{step}", "2000", 2000),
    ],
)
def test_step_patterns(pattern, name, step):
    assert match_step(compile_step_pattern(pattern), name) == step


def test_directory_and_file_checkpoints_are_grouped_into_series():
    listing = [
        obj("run1/step_1000/model.pt"),
        obj("run1/step_1000/.metadata"),
        obj("run1/step_2000/model.pt"),
        obj("run2/step_1000/deep/nested/shard"),
        obj("run2/step_1000/deep/COMPLETE.txt"),
        obj("ckpt-100.pt"),
        obj("ckpt-200.pt"),
        obj("run1/notes.txt"),
        obj("README"),
    ]
    catalog = build_catalog(listing, RULES)
    names = [s.name for s in catalog.series]
    assert names == ["ckpt-{step}.pt", "run1/step_{step}", "run2/step_{step}"]
    by_path = {c.path: c for c in catalog.checkpoints}
    assert by_path["run1/step_1000"].complete and by_path["run1/step_1000"].kind == "directory"
    assert by_path["run1/step_1000"].marker_keys == ("run1/step_1000/.metadata",)
    assert not by_path["run1/step_2000"].complete
    assert by_path["run2/step_1000"].complete  # nested marker, glob
    assert by_path["ckpt-100.pt"].kind == "file" and by_path["ckpt-100.pt"].complete
    assert [o.key for o in catalog.unmanaged] == ["README", "run1/notes.txt"]


def test_outermost_match_owns_everything_below():
    listing = [obj("run1/step_10/ckpt-3.pt"), obj("run1/step_10/sub/step_5/x"), obj("run1/step_10/.metadata")]
    (series,) = build_catalog(listing, RULES).series
    (cp,) = series.checkpoints
    assert cp.path == "run1/step_10" and cp.objects.__len__() == 3 and cp.complete


def test_first_pattern_wins_for_a_name():
    # "step_7" could match "*-{step}" only if it contained '-'; "a-step_7" does not match step_{step}.
    catalog = build_catalog([obj("x/a-7/f"), obj("x/step_7/f")], RULES)
    assert sorted(s.pattern for s in catalog.series) == ["*-{step}", "step_{step}"]


def test_directory_placeholder_objects_belong_to_the_checkpoint():
    catalog = build_catalog([obj("run1/step_1/"), obj("run1/step_1/model")], RULES)
    (cp,) = catalog.checkpoints
    assert cp.kind == "directory" and len(cp.objects) == 2


def test_storage_class_is_mixed_when_objects_differ_and_age_uses_newest_object():
    listing = [
        obj("step_1/a", storage_class="STANDARD", age_days=10),
        obj("step_1/b", storage_class="GLACIER_IR", age_days=3),
        obj("step_2/a", storage_class=None, age_days=3),  # S3 may omit STANDARD
    ]
    cps = {c.path: c for c in build_catalog(listing, RULES).checkpoints}
    assert cps["step_1"].storage_class == "mixed"
    assert cps["step_1"].last_modified == NOW - timedelta(days=3)
    assert cps["step_1"].bytes == 2000
    assert cps["step_2"].storage_class == "STANDARD"


def test_series_are_ordered_by_step_not_by_name():
    listing = [obj(f"step_{s}/x") for s in (900, 10000, 1000)]
    (series,) = build_catalog(listing, RULES).series
    assert [c.step for c in series.checkpoints] == [900, 1000, 10000]


def test_s3_style_mappings_are_accepted():
    entry = {"Key": "ckpt-1.pt", "Size": 5, "LastModified": NOW, "StorageClass": "STANDARD"}
    (cp,) = build_catalog([entry], RULES).checkpoints
    assert cp.bytes == 5


def test_store_listing_objects_are_accepted_and_etag_is_carried():
    @dataclass(frozen=True)
    class StoreSummary:  # the shape of an object store's listing entry
        key: str
        size: int
        etag: str
        last_modified: datetime
        storage_class: str | None = None

    (cp,) = build_catalog([StoreSummary("ckpt-1.pt", 7, "abc", NOW)], RULES).checkpoints
    assert cp.objects == (ListedObject("ckpt-1.pt", 7, NOW, "STANDARD", None, "abc"),)


def test_naive_datetimes_and_duplicates_are_refused():
    with pytest.raises(ValueError, match="timezone-aware"):
        build_catalog([ListedObject("ckpt-1.pt", 1, datetime(2025, 1, 1))], RULES)
    with pytest.raises(ValueError, match="duplicate key"):
        build_catalog([obj("ckpt-1.pt"), obj("ckpt-1.pt")], RULES)


def test_mtime_tag_overrides_last_modified():
    original = NOW - timedelta(days=40)
    listing = [
        obj("ckpt-1.pt", age_days=0, tags={MTIME_TAG: original.isoformat()}),
        obj("ckpt-2.pt", age_days=0, tags={MTIME_TAG: str(original.timestamp())}),
        obj("ckpt-3.pt", age_days=0, tags={MTIME_TAG: "garbage"}),
    ]
    catalog = build_catalog(listing, RULES)
    cps = {c.path: c for c in catalog.checkpoints}
    assert cps["ckpt-1.pt"].last_modified == original
    assert cps["ckpt-2.pt"].last_modified == original
    assert cps["ckpt-3.pt"].last_modified == NOW
    assert any(MTIME_TAG in w for w in catalog.warnings)


def test_a_nested_marker_completes_only_a_checkpoint_it_covers():
    # The drain orders a marker after the files below its own directory only: a marker in
    # one subdirectory says nothing about a sibling subdirectory still uploading.
    listing = [
        obj("run/step_1/model/.metadata"),
        obj("run/step_1/model/shard"),
        obj("run/step_1/optim/shard"),
        obj("run/step_2/model/.metadata"),
        obj("run/step_2/model/shard"),
    ]
    by_path = {c.path: c for c in build_catalog(listing, RULES).checkpoints}
    assert not by_path["run/step_1"].complete
    assert by_path["run/step_2"].complete
