"""Plan output: --json list form, summary, and the 80-column table."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from ckptfs.lifecycle.catalog import ListedObject
from ckptfs.lifecycle.planner import plan
from ckptfs.lifecycle.render import (
    elide_middle,
    elide_path,
    format_age,
    format_size,
    format_size_long,
    plan_to_json,
    render_table,
    summary_to_json,
)
from ckptfs.lifecycle.rules import LifecycleRules, Tier

NOW = datetime(2025, 6, 1, tzinfo=timezone.utc)
GIB = 1 << 30
LONG_RUN = "team-foundation-models/pretraining/llama-70b-sweep-lr3e-4-warmup2000-seed1234/checkpoints"
RULES = LifecycleRules(
    checkpoints=("step_{step}", "ckpt-{step}.pt"),
    markers=(".metadata",),
    keep_latest=2,
    keep_every_steps=10000,
    expire_after_days=14,
    incomplete_grace_hours=24,
    tiers=(Tier(7, "GLACIER_IR"), Tier(100, "INTELLIGENT_TIERING_ARCHIVE_LONG_NAME")),
    prices={"STANDARD": 0.023, "GLACIER_IR": 0.004},
)


def sample_plan():
    listing = []
    for i, step in enumerate(range(5000, 35000, 5000)):
        mtime = NOW - timedelta(days=30 - 4 * i)
        base = f"{LONG_RUN}/step_{step}"
        listing += [
            ListedObject(f"{base}/model.safetensors", 140 * GIB, mtime),
            ListedObject(f"{base}/.metadata", 900, mtime),
        ]
    listing.append(ListedObject(f"{LONG_RUN}/step_40000/model.safetensors", 10 * GIB, NOW))  # in flight
    listing.append(ListedObject("ckpt-1.pt", 123, NOW - timedelta(hours=3)))
    listing.append(ListedObject("ckpt-2.pt", 12345, NOW - timedelta(minutes=5), "COLD"))
    listing.append(ListedObject("misc/notes.txt", 10, NOW))
    return plan(listing, RULES, {"no/such/pin"}, NOW)


@pytest.mark.parametrize("width", [80, 60, 100, 120])
def test_table_fits_width_with_long_paths(width):
    table = render_table(sample_plan(), width=width)
    lines = table.splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    # The checkpoint name survives elision.
    assert any("step_10000" in line for line in lines)
    if width >= 80:  # and, given room, so does the head of the path
        assert any(line.startswith("team-") and "/step_25000" in line for line in lines)


def test_table_shows_actions_reasons_and_totals():
    table = render_table(sample_plan())
    assert table.splitlines()[0].split() == ["PATH", "SIZE", "CLASS", "AGE", "ACTION", "REASONS"]
    assert "DELETE" in table and "expired" in table
    assert "tier:GLACIER_IR after 7d" in table
    assert "incomplete-newest" in table
    assert "cost/month" in table and "$" in table
    assert "(cost leaves out COLD" in table
    assert "warning: pin 'no/such/pin' matches no checkpoint" in table
    assert "not part of any checkpoint (left alone): 1 object, 10 B" in table
    assert "STANDARD" in table and "GLACIER_IR" in table


def test_empty_plan_renders():
    table = render_table(plan([], LifecycleRules(), set(), NOW))
    assert table.startswith("no checkpoints found")
    assert "cost/month" not in table  # no prices configured


def test_plan_to_json_is_a_list_with_the_contract_keys():
    data = plan_to_json(sample_plan())
    assert isinstance(data, list) and len(data) == 9
    required = {"path", "step", "complete", "bytes", "storage_class", "action", "target_class", "reasons"}
    assert all(required <= entry.keys() for entry in data)
    by_path = {e["path"]: e for e in data}
    entry = by_path[f"{LONG_RUN}/step_10000"]
    assert entry["action"] == "transition" and entry["target_class"] == "GLACIER_IR"
    assert entry["reasons"] == ["milestone", "tier:GLACIER_IR after 7d"]
    assert "delete_batches" not in entry
    json.dumps(data)


def test_plan_to_json_with_keys():
    data = plan_to_json(sample_plan(), include_keys=True)
    deleted = next(e for e in data if e["action"] == "delete")
    assert deleted["delete_batches"][0] == [deleted["path"] + "/.metadata"]
    assert deleted["delete_batches"][1] == [deleted["path"] + "/model.safetensors"]


def test_summary_to_json():
    summary = summary_to_json(sample_plan())
    json.dumps(summary)
    assert summary["bytes_before"]["STANDARD"] > summary["bytes_after"]["STANDARD"]
    assert summary["cost_after"] < summary["cost_before"]
    assert summary["unpriced_classes"] == ["COLD"]
    assert summary["warnings"] == ["pin 'no/such/pin' matches no checkpoint in the listing"]


@pytest.mark.parametrize(
    "n, short, long",
    [
        (0, "0B", "0 B"),
        (1023, "1023B", "1023 B"),
        (1024, "1.0K", "1 KiB"),
        (1536, "1.5K", "1.5 KiB"),
        (140 * GIB, "140G", "140 GiB"),
        (1023 * GIB, "1023G", "1023 GiB"),
        (1024 * GIB - 1, "1.0T", "1 TiB"),
        (5 << 50, "5.0P", "5 PiB"),
    ],
)
def test_sizes(n, short, long):
    assert format_size(n) == short
    assert len(format_size(n)) <= 5
    assert format_size_long(n) == long


def test_ages():
    assert format_age(0.01) == "14m"
    assert format_age(0.5) == "12.0h"
    assert format_age(3.25) == "3.2d"
    assert format_age(45.2) == "45d"
    assert format_age(-1) == "0m"


def test_elision():
    assert elide_path("run/step_1", 20) == "run/step_1"
    assert elide_path("very-long-run-name/step_1000", 20) == "very-lo.../step_1000"
    assert elide_path("x/" + "a" * 30, 10) == "...aaaaaaa"
    assert len(elide_path("a/b/c/d/e/f/g/h", 5)) == 5
    assert elide_middle("INTELLIGENT_TIERING", 12) == "INTEL...RING"
