"""``ckptfs lifecycle plan|apply`` and ``ckptfs promote`` as processes, on file:// buckets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from conftest import REPO, ckptfs_cmd  # noqa: E402
from ckptfs.drain.factory import open_store  # noqa: E402
from ckptfs.cli.lifecycle import UsageError, parse_duration, parse_now  # noqa: E402

from test_lifecycle_executor import make_checkpoints, run  # noqa: E402

CONFIG = """\
bucket_url = "{url}"
[cache]
dir = "{cache}"
[lifecycle]
checkpoints = ["step_{{step}}"]
markers = [".metadata"]
keep_latest = 1
keep_every_steps = 200
expire_after_days = 7
{extra}
[[lifecycle.tiers]]
after_days = 3
storage_class = "COLD"
"""


def cli(*args, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([*ckptfs_cmd(), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(REPO), env=full_env)


class Bucket:
    def __init__(self, tmp: Path, extra: str = ""):
        self.root = tmp / "bucket"
        self.root.mkdir(exist_ok=True)
        self.url = f"file://{self.root}"
        self.store = open_store(self.url)
        self.config = tmp / "ckptfs.toml"
        self.config.write_text(CONFIG.format(url=self.url, cache=tmp / "no-cache", extra=extra))

    def fill(self, parent: str = "run1") -> None:
        make_checkpoints(self.store, [(100, 10), (200, 8), (300, 6), (400, 4), (500, 2)], parent=parent)

    def keys(self) -> set[str]:
        async def go():
            return {o.key for o in (await self.store.list()).objects}

        return run(go)

    def head(self, key: str):
        return run(self.store.head, key)


@pytest.fixture
def bucket(tmp_path) -> Bucket:
    return Bucket(tmp_path)


def plan_json(bucket: Bucket, *extra) -> list[dict]:
    r = cli("lifecycle", "plan", "--config", str(bucket.config), "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# --------------------------------------------------------------------------- plan


def test_plan_json_is_a_list_with_the_contract_fields(bucket):
    bucket.fill()
    before = bucket.keys()
    data = plan_json(bucket)
    assert isinstance(data, list) and len(data) == 5
    for item in data:
        for field in ("path", "step", "complete", "bytes", "storage_class", "action", "target_class", "reasons"):
            assert field in item, field
    by_path = {d["path"]: d for d in data}
    assert by_path["run1/step_100"]["action"] == "delete" and by_path["run1/step_100"]["reasons"] == ["expired"]
    assert by_path["run1/step_300"]["action"] == "transition"
    assert by_path["run1/step_300"]["target_class"] == "COLD"
    assert by_path["run1/step_500"]["reasons"] == ["latest"]
    assert by_path["run1/step_500"]["step"] == 500 and by_path["run1/step_500"]["complete"] is True
    assert bucket.keys() == before  # plan changes nothing
    # BUCKET_URL on the command line wins over the config's bucket_url; --keys adds the work
    data = json.loads(cli("lifecycle", "plan", bucket.url, "--config", str(bucket.config), "--json", "--keys").stdout)
    entry = next(d for d in data if d["path"] == "run1/step_100")
    assert entry["delete_batches"][0] == ["run1/step_100/.metadata"]


def test_table_fits_80_columns(tmp_path):
    bucket = Bucket(tmp_path)
    bucket.fill(parent="a-rather-long-experiment-name/with/several/levels/of/nesting-and-more")
    bucket.fill(parent="run1")
    r = cli("lifecycle", "plan", "--config", str(bucket.config), env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:6] == ["PATH", "SIZE", "CLASS", "AGE", "ACTION", "REASONS"]
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert any("step_300" in line and "tier" in line for line in lines)


@pytest.mark.parametrize("setting, value, words", [
    ("keep_latest", '"three"', ["lifecycle.keep_latest", "integer"]),
    ("keep_lastest", "3", ["keep_lastest", "keep_latest"]),
    ("expire_after_days", "-1", ["lifecycle.expire_after_days"]),
])
def test_bad_lifecycle_setting_exits_2_naming_it(tmp_path, setting, value, words):
    bucket = Bucket(tmp_path)
    text = bucket.config.read_text()
    if f"\n{setting} = " in text:
        lines = [f"{setting} = {value}" if line.startswith(f"{setting} = ") else line for line in text.splitlines()]
        bucket.config.write_text("\n".join(lines) + "\n")
    else:
        bucket = Bucket(tmp_path, extra=f"{setting} = {value}")
    for command in ("plan", "apply"):
        r = cli("lifecycle", command, "--config", str(bucket.config))
        assert r.returncode == 2, r.stderr
        for word in words:
            assert word in r.stderr
        assert r.stdout == ""


def test_bad_tier_and_other_settings_exit_2(tmp_path):
    bucket = Bucket(tmp_path)
    bucket.config.write_text(bucket.config.read_text().replace('storage_class = "COLD"', 'storage_class = "no good"'))
    r = cli("lifecycle", "plan", "--config", str(bucket.config))
    assert r.returncode == 2 and "lifecycle.tiers[0].storage_class" in r.stderr
    bucket.config.write_text('bucket_url = "file:///tmp/x"\n[drain]\nchecksum = "bogus"\n')
    r = cli("lifecycle", "plan", "--config", str(bucket.config))
    assert r.returncode == 2 and "drain.checksum" in r.stderr
    r = cli("lifecycle", "plan")
    assert r.returncode == 2 and "bucket_url" in r.stderr
    r = cli("lifecycle", "apply", bucket.url, "--every", "soon")
    assert r.returncode == 2 and "--every" in r.stderr


def test_warnings_go_to_stderr(tmp_path):
    bucket = Bucket(tmp_path, extra='prices = {STANDARD = 0.023}')
    bucket.fill()
    r = cli("lifecycle", "plan", "--config", str(bucket.config), "--json")
    assert r.returncode == 0
    assert "warning: lifecycle.prices: no price for COLD" in r.stderr
    json.loads(r.stdout)


def test_missing_file_bucket_is_an_error(tmp_path):
    r = cli("lifecycle", "plan", f"file://{tmp_path}/nope")
    assert r.returncode == 1 and "NoSuchBucket" in r.stderr


# --------------------------------------------------------------------------- apply


def test_apply_then_apply_again_does_nothing(bucket):
    bucket.fill()
    r = cli("lifecycle", "apply", "--config", str(bucket.config))
    assert r.returncode == 0, r.stderr
    assert "applied: deleted 3 object(s) of 1 checkpoint(s); moved 6 object(s) by copy" in r.stdout
    assert "delete run1/step_100/.metadata (batch 1/2)" in r.stderr  # every action is logged
    assert "copy run1/step_300/shard0 -> COLD" in r.stderr
    assert not any(k.startswith("run1/step_100/") for k in bucket.keys())
    assert bucket.head("run1/step_300/shard0").storage_class == "COLD"
    snapshot = {k: (h.storage_class, h.last_modified, h.etag) for k in bucket.keys() for h in [bucket.head(k)]}

    again = cli("lifecycle", "apply", "--config", str(bucket.config), "--json")
    assert again.returncode == 0, again.stderr
    data = json.loads(again.stdout)
    assert all(d["action"] == "keep" and d["result"] is None for d in data)
    assert "nothing to do" in again.stderr
    assert {k: (h.storage_class, h.last_modified, h.etag) for k in bucket.keys() for h in [bucket.head(k)]} == snapshot


def test_apply_json_reports_results(bucket):
    bucket.fill()
    r = cli("lifecycle", "apply", "--config", str(bucket.config), "--json")
    assert r.returncode == 0, r.stderr
    by_path = {d["path"]: d for d in json.loads(r.stdout)}
    assert by_path["run1/step_100"]["result"]["status"] == "done"
    assert by_path["run1/step_100"]["result"]["deleted"] == 3
    assert by_path["run1/step_300"]["result"] == {"status": "done", "detail": "", "deleted": 0, "tagged": 0,
                                                  "copied": 2, "waiting": 0, "errors": []}
    assert by_path["run1/step_500"]["result"] is None


def test_dry_run_changes_nothing(bucket):
    bucket.fill()
    before = {k: bucket.head(k) for k in bucket.keys()}
    r = cli("lifecycle", "apply", "--config", str(bucket.config), "--dry-run")
    assert r.returncode == 0 and "DELETE" in r.stdout and "applied" not in r.stdout
    assert {k: bucket.head(k) for k in bucket.keys()} == before


def test_now_option_ages_the_bucket(bucket):
    make_checkpoints(bucket.store, [(100, 0), (200, 0), (300, 0)])
    assert {d["action"] for d in plan_json(bucket)} == {"keep"}
    later = {d["path"]: d for d in plan_json(bucket, "--now", "+8d")}
    assert later["run1/step_100"]["action"] == "delete"
    assert later["run1/step_200"]["action"] == "transition"  # milestone, tiered


def test_pending_keys_of_a_cache_dir_are_protected(tmp_path):
    from test_drain_support import DrainEnv

    env = DrainEnv(tmp_path)
    try:
        bucket = Bucket(tmp_path)
        assert bucket.url == env.settings.bucket_url
        bucket.fill()
        env.write_file("run1/step_100/straggler", b"late" * 100)
        dirs = [env.ino("run1"), env.ino("run1/step_100")]
        env.meta.write(lambda txn: [txn.clear_pending(ino) for ino in dirs])
    finally:
        env.close()
    r = cli("lifecycle", "apply", "--config", str(bucket.config), "--cache-dir", str(env.cache), "--json")
    assert r.returncode == 0, r.stderr
    by_path = {d["path"]: d for d in json.loads(r.stdout)}
    assert by_path["run1/step_100"]["action"] == "keep"
    assert "pending-upload" in by_path["run1/step_100"]["reasons"]
    assert bucket.head("run1/step_100/.metadata") is not None
    assert by_path["run1/step_300"]["result"]["status"] == "done"
    # the config's [cache] dir is used when it exists
    bucket.config.write_text(bucket.config.read_text().replace(str(tmp_path / "no-cache"), str(env.cache)))
    assert "pending-upload" in {d["path"]: d for d in plan_json(bucket, "--now", "+30d")}["run1/step_100"]["reasons"]
    # a cache of another bucket is refused when named explicitly
    (tmp_path / "elsewhere").mkdir()
    other = Bucket(tmp_path / "elsewhere")
    r = cli("lifecycle", "plan", other.url, "--cache-dir", str(env.cache))
    assert r.returncode == 2 and "belongs to" in r.stderr


def test_every_loops_until_sigterm(bucket):
    bucket.fill()
    proc = subprocess.Popen([*ckptfs_cmd(), "lifecycle", "apply", "--config", str(bucket.config), "--every", "1s",
                             "--json"], cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        seen = []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            seen.append(line)
            if "lifecycle run 3 " in line:
                break
        assert any("lifecycle run 3 " in line for line in seen), "".join(seen)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    runs = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(runs) >= 2  # one compact JSON list per run
    assert any(d["action"] == "delete" for d in runs[0])
    assert all(d["action"] == "keep" for d in runs[1])
    assert "nothing to do" in "".join(seen) + err
    assert "stopped after" in err


# --------------------------------------------------------------------------- promote


def test_promote_and_undo(bucket):
    bucket.fill()
    r = cli("promote", "run1/step_100", "--config", str(bucket.config))
    assert r.returncode == 0, r.stderr
    assert "pinned run1/step_100" in r.stdout
    assert ".ckptfs/pins/run1/step_100/" in bucket.keys()
    # a bucket URL inside --bucket names the same pin
    r = cli("promote", f"{bucket.url}/run1/step_100", "--bucket", bucket.url)
    assert r.returncode == 0 and "already pinned" in r.stdout
    by_path = {d["path"]: d for d in plan_json(bucket)}
    assert ".ckptfs" not in "".join(by_path)
    assert by_path["run1/step_100"]["action"] == "keep" and "promoted" in by_path["run1/step_100"]["reasons"]
    r = cli("lifecycle", "apply", "--config", str(bucket.config))
    assert r.returncode == 0, r.stderr
    assert bucket.head("run1/step_100/.metadata") is not None

    r = cli("promote", "run1/step_100", "--config", str(bucket.config), "--undo")
    assert r.returncode == 0 and "unpinned run1/step_100" in r.stdout
    assert not any(k.startswith(".ckptfs/") for k in bucket.keys())
    assert plan_json(bucket)[0]["action"] == "delete"
    r = cli("promote", "run1/step_100", "--config", str(bucket.config), "--undo")
    assert r.returncode == 0 and "was not pinned" in r.stdout


def test_promote_refuses_what_it_cannot_place(bucket, tmp_path):
    r = cli("promote", "s3://some-bucket/p/step_1")
    assert r.returncode == 2 and "--bucket" in r.stderr
    r = cli("promote", "file:///elsewhere/step_1", "--bucket", bucket.url)
    assert r.returncode == 2 and "not inside" in r.stderr
    r = cli("promote", "../x", "--bucket", bucket.url)
    assert r.returncode == 2 and "'..'" in r.stderr
    r = cli("promote", str(tmp_path / "not-a-mount"))
    assert r.returncode == 2 and "not on a ckptfs mount" in r.stderr
    r = cli("promote", "run1/step_7", "--bucket", bucket.url)
    assert r.returncode == 0 and "nothing in" in r.stderr  # pinned ahead of time, with a warning


# --------------------------------------------------------------------------- parsing


def test_parse_duration_and_now():
    assert parse_duration("1h") == 3600
    assert parse_duration("30m") == 1800
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90") == 90
    assert parse_duration("2d") == 2 * 86400
    for bad in ("", "soon", "0s", "1y"):
        with pytest.raises(UsageError):
            parse_duration(bad)
    assert parse_now("2025-01-02T03:04:05+00:00").isoformat() == "2025-01-02T03:04:05+00:00"
    assert parse_now("2025-01-02T03:04:05").tzinfo is not None
    delta = parse_now("+2d") - parse_now(None)
    assert abs(delta.total_seconds() - 2 * 86400) < 5
    with pytest.raises(UsageError):
        parse_now("tomorrow")
