"""``ckptfs status`` and ``ckptfs wait-durable``: what is not in the bucket yet.

``ckptfs status --json`` prints one object (``--watch``: one per refresh, a line each):

==================================  ==============================================================
field                               meaning
==================================  ==============================================================
``bucket_url``, ``cache_dir``       what this cache drains to, and where it is
``data_path``                       the gateway's data path: ``passthrough`` or ``writeback``
                                    (null when no gateway has recorded one)
``fuse_transport``                  how FUSE requests reach the gateway: ``io_uring`` (a queue
                                    per CPU) or ``dev_fuse``
``gateway_pid``, ``drain_pid``      the processes working on the cache (null: none)
``drain``                           the drain's health: ``state`` (``running``, ``starting``,
                                    ``down``, ``crash-looping``, ``not running``), ``summary``
                                    (the line ``status`` prints), ``pid``, ``supervised`` (a
                                    gateway watches it), ``restarts`` (since the mount),
                                    ``last_exit`` (``exited N``, ``killed by SIGKILL``),
                                    ``last_error`` (its last error line), ``crash_looping_since``
                                    (UTC, ISO 8601) and ``restart_in_seconds``
``metrics_endpoint``                with a live gateway: ``addr``, ``serving`` (false: the
                                    address was taken, e.g. by another mount) and ``error``
``pending_files``                   files and directories whose bucket object does not match yet
``pending_bytes``                   bytes still to upload (moves cost none)
``pending_deletes``                 bucket keys still to delete
``oldest_pending_age_seconds``      how long the longest-waiting entry has waited (null: none)
``upload_rate_bytes_per_second``    the drain's recent upload rate (null: no drain has said)
``uploaded_bytes``/``_files``       totals since the drain started
``errors``                          path -> permanent error code; also ``delete KEY`` -> the
                                    code of a failed delete, and records the drain could not
                                    read (``<inode N>``)
``node``                            this cache's node id (it names the node's in-flight records)
``records``                         with a live gateway: ``unpublished`` (in-flight records it
                                    could not put yet, retried) and ``failed_puts`` (puts that
                                    ran out of ``publish_timeout`` since the mount)
``held_markers``                    marker path -> ``nodes`` (the other nodes whose files of the
                                    checkpoint are not in the bucket yet), ``since_ns``, and
                                    ``lost``: node -> when it was last heard of (UTC), for those
                                    silent for ``[cluster] node_timeout``
``unexpected_errors``               unforeseen exceptions the drain caught around one file or
                                    key since it started (each also logged with its traceback)
``retrying``                        operation -> retry state, for retryable errors
``cache``                           ``used_bytes`` (cache files), ``dirty_bytes``, and the cache
                                    device's ``device_bytes`` and ``device_free_bytes``
``checkpoints``                     with ``--by-checkpoint``: one object per checkpoint, below
==================================  ==============================================================

A checkpoint (``--by-checkpoint``) is what the lifecycle engine calls one: a directory or file
whose name matches a ``[lifecycle] checkpoints`` pattern, or, when none is configured,
:data:`DEFAULT_CHECKPOINT_PATTERNS`. Each row: ``path``, ``step``, ``files``, ``bytes``,
``dirty``, ``uploading``, ``durable``, ``errors`` (file counts), ``pending_bytes``,
``oldest_pending_age_seconds``, ``eta_seconds`` (at the current upload rate, counting what the
drain sends first; null when unknown or nothing is pending), ``complete`` (a commit marker
exists) and ``marker_in_bucket`` (that marker is durable in the bucket).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ckptfs.fsmeta import durability
from ckptfs.fsmeta.layout import CacheDir
from ckptfs.fsmeta.settings import DEFAULT_MARKERS
from ckptfs.gateway.mountpoint import NotOnMount, find_mount
from ckptfs.lifecycle.catalog import ListedObject, build_catalog
from ckptfs.lifecycle.render import elide_path
from ckptfs.lifecycle.rules import LifecycleConfigError, LifecycleRules, rules_from_table

from .common import human_bytes

# Checkpoint names of the common trainers (DCP/torch step dirs, Hugging Face, Megatron,
# DeepSpeed), used by --by-checkpoint when [lifecycle] configures none.
DEFAULT_CHECKPOINT_PATTERNS = ("step_{step}", "step-{step}", "checkpoint-{step}", "checkpoint_{step}",
                               "iter_{step}", "global_step{step}")


class OtherNodes:
    """The other nodes' in-flight records under a path (one LIST of the bucket per look)."""

    def __init__(self, meta, rel: str):
        from ckptfs.fsmeta.settings import Settings

        with meta.read() as txn:
            self.settings = Settings.from_json(txn.get_settings() or {})
            self.node = txn.get_node_id()
        self.rel = rel
        self.next_look = 0.0
        self.nodes: list[str] = []

    def holding(self, every: float = 1.0) -> list[str]:
        if time.monotonic() >= self.next_look:
            import trio

            from ckptfs.drain.cluster import other_nodes_under
            from ckptfs.drain.factory import open_store_for

            async def look() -> list[str]:
                async with open_store_for(self.settings) as store:
                    return await other_nodes_under(store, self.rel, self.node)

            try:
                self.nodes = trio.run(look)
            except Exception as exc:  # unknown is not "none": keep waiting, and say why
                self.nodes = [f"(the bucket's records cannot be listed: {type(exc).__name__})"]
            self.next_look = time.monotonic() + every
        return self.nodes


def wait_durable(path: str, *, timeout: float | None = None, show_progress: bool = False,
                 out=sys.stderr, interval: float = 0.2, local: bool = False) -> bool:
    """Block until everything at or under ``path`` is durable, on this node and (unless
    ``local``) on every other node that holds files there; False on timeout (pending printed)."""
    root, cache_dir, rel = find_mount(path)
    meta = CacheDir(cache_dir).open_meta()
    others = None if local else OtherNodes(meta, rel)
    waiting_for: list[str] = []
    console = Console(file=out)
    progress = Progress(TextColumn("waiting for the bucket"), BarColumn(), DownloadColumn(),
                        TextColumn("{task.fields[files]} files, {task.fields[deletes]} deletes"),
                        TimeElapsedColumn(), console=console, transient=True, disable=not show_progress)
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        start_bytes = 0
        warned = set()
        lost: set[str] = set()
        with progress:
            task = progress.add_task("wait", total=None, files=0, deletes=0)
            while True:
                with meta.read() as txn:
                    backlog = durability.pending_under(txn, rel)
                if backlog.empty:
                    waiting_for = others.holding() if others is not None else []
                    if not waiting_for:
                        return True
                for p, error in backlog.errors.items():
                    if p not in warned:
                        warned.add(p)
                        why = ("its cache file lost data that was never fsynced; it will not be uploaded "
                               "until it is written again" if error in durability.CACHE_LOST_CODES
                               else "data kept in the cache; retrying")
                        console.print(f"ckptfs: {p}: upload failing: {error} ({why})", markup=False,
                                      highlight=False)
                lost = {p for p, error in backlog.errors.items() if error in durability.CACHE_LOST_CODES}
                if lost and not backlog.deletes and all(p in lost for p, _, _ in backlog.files):
                    break  # nothing left will ever become durable on its own
                start_bytes = max(start_bytes, backlog.bytes)
                progress.update(task, total=start_bytes or None, completed=start_bytes - backlog.bytes,
                                files=len(backlog.files), deletes=len(backlog.deletes))
                if deadline is not None and time.monotonic() >= deadline:
                    break
                time.sleep(interval)
        out.write(f"ckptfs: {'timed out; ' if not lost else ''}still pending under {path}:\n")
        for node in waiting_for:
            out.write(f"  {'node':10} {'':>10}  {node} (its files there are not in the bucket yet)\n")
        for p, size, state in backlog.files[:50]:
            out.write(f"  {state:10} {human_bytes(size):>10}  {p}\n")
        for key in backlog.deletes[:50]:
            out.write(f"  {'delete':10} {'':>10}  {key}\n")
        more = len(backlog.files) + len(backlog.deletes) - 100
        if more > 0:
            out.write(f"  … and {more} more\n")
        return False
    finally:
        meta.close()


def cmd_wait_durable(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        ok = wait_durable(args.path, timeout=args.timeout, show_progress=sys.stderr.isatty(), local=args.local)
    except NotOnMount as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return 2
    return 0 if ok else 1


# -- status ---------------------------------------------------------------------------------


def _age(now_ns: int, since_ns: int | None) -> float | None:
    return None if since_ns is None else max(0.0, (now_ns - since_ns) / 1e9)


def _cache_usage(cache: CacheDir, dirty_bytes: int, space: dict) -> dict:
    """Cache use; with a live gateway also its cap and evictions (``meta/space_status``)."""
    fs = os.statvfs(cache.root)
    return {"used_bytes": cache.used_bytes(), "dirty_bytes": dirty_bytes,
            "device_bytes": fs.f_blocks * fs.f_frsize, "device_free_bytes": fs.f_bavail * fs.f_frsize,
            "max_bytes": space.get("cap_bytes"), "high_watermark_bytes": space.get("high_bytes"),
            "low_watermark_bytes": space.get("low_bytes"),
            "evictions": space.get("evictions_total", 0), "evicted_bytes": space.get("evicted_bytes_total", 0)}


def _backpressure(space: dict) -> dict:
    """Writers waiting for cache space (live gateway only)."""
    return {"waiting_writers": space.get("waiting_writers", 0),
            "longest_wait_seconds": space.get("longest_wait_seconds", 0.0),
            "wait_seconds_total": space.get("wait_seconds_total", 0.0),
            "refused_writes": space.get("enospc_total", 0),
            "timeout_seconds": space.get("backpressure_timeout")}


def _checkpoint_rules(settings: dict) -> LifecycleRules:
    try:
        rules = rules_from_table(settings.get("lifecycle") or {})
    except LifecycleConfigError:
        rules = LifecycleRules()
    markers = tuple(rules.markers or settings.get("markers") or DEFAULT_MARKERS)
    return LifecycleRules(checkpoints=rules.checkpoints or DEFAULT_CHECKPOINT_PATTERNS, markers=markers)


def checkpoint_rows(files: list[durability.FileStatus], rules: LifecycleRules, *, now_ns: int,
                    rate: float | None) -> list[dict]:
    """One row per checkpoint of the local namespace (see the module docstring)."""
    by_path = {f.path: f for f in files}
    listing = [ListedObject(f.path, f.size, datetime.fromtimestamp(f.mtime_ns / 1e9, timezone.utc))
               for f in files]
    rows = []
    for series in build_catalog(listing, rules).series:
        for ckpt in series.checkpoints:
            members = [by_path[o.key] for o in ckpt.objects]
            pending = [f for f in members if f.pending_since_ns is not None]
            markers = [by_path[k] for k in ckpt.marker_keys]
            rows.append({
                "path": ckpt.path, "step": ckpt.step, "files": len(members), "bytes": ckpt.bytes,
                "dirty": sum(f.state == "dirty" for f in members),
                "uploading": sum(f.state == "uploading" for f in members),
                "durable": sum(f.pending_since_ns is None for f in members),
                "errors": sum(f.state == "error" for f in members),
                "pending_bytes": sum(f.bytes_to_upload for f in pending),
                "oldest_pending_age_seconds": _age(now_ns, min((f.pending_since_ns for f in pending), default=None)),
                "eta_seconds": None,
                "complete": ckpt.complete,
                "marker_in_bucket": any(f.pending_since_ns is None for f in markers),
            })
    # The drain sends the oldest pending first: a checkpoint waits for everything older.
    queued = 0
    for row in sorted((r for r in rows if r["oldest_pending_age_seconds"] is not None),
                      key=lambda r: -r["oldest_pending_age_seconds"]):
        queued += row["pending_bytes"]
        if rate:
            row["eta_seconds"] = queued / rate
    rows.sort(key=lambda r: (r["path"].rsplit("/", 1)[0], r["step"]))
    return rows


def collect(cache: CacheDir, rel: str, *, by_checkpoint: bool) -> dict:
    meta = cache.open_meta()
    try:
        with meta.read() as txn:
            backlog = durability.pending_under(txn, rel)
            whole = durability.pending_under(txn, "") if rel else backlog
            drain = txn.get_drain_status() or {}
            gateway = txn.get_gateway_status() or {}
            space = txn.get_space_status() or {}
            settings = txn.get_settings() or {}
            node = txn.get_node_id()
            files = durability.file_states(txn) if by_checkpoint else []
    finally:
        meta.close()
    now = time.time_ns()
    gateway_pid = cache.gateway_pid()
    drain_pid = cache.drain_pid()
    if not gateway_pid:
        space = {}  # a stopped gateway's last figures are not live
    report = {
        "bucket_url": settings.get("bucket_url"),
        "cache_dir": cache.root,
        "data_path": gateway.get("data_path") if gateway_pid else None,
        "fuse_transport": gateway.get("fuse_transport") if gateway_pid else None,
        "gateway_pid": gateway_pid,
        "drain_pid": drain_pid,
        "drain": drain_health(gateway, gateway_pid, drain_pid, now),
        "metrics_endpoint": metrics_endpoint(gateway, gateway_pid),
        "records": (gateway.get("records") or {"unpublished": 0, "failed_puts": 0}) if gateway_pid else None,
        "pending_files": len(backlog.files),
        "pending_bytes": backlog.bytes,
        "pending_deletes": len(backlog.deletes),
        "oldest_pending_age_seconds": _age(now, backlog.oldest_since_ns),
        "upload_rate_bytes_per_second": drain.get("upload_rate_bytes_per_second"),
        "errors": {**_drain_errors_under(drain, rel), **backlog.errors},
        "unexpected_errors": drain.get("unexpected_errors", 0),
        "node": node,
        "held_markers": drain.get("held_markers", {}) if report_drain_live(drain) else {},
        "retrying": drain.get("retrying", {}),
        "uploaded_bytes": drain.get("uploaded_bytes", 0),
        "uploaded_files": drain.get("uploaded_files", 0),
        "cache": _cache_usage(cache, whole.bytes, space),
        "backpressure": _backpressure(space),
    }
    if by_checkpoint:
        prefix = rel + "/" if rel else ""
        rows = checkpoint_rows(files, _checkpoint_rules(settings), now_ns=now,
                               rate=report["upload_rate_bytes_per_second"])
        report["checkpoints"] = [r for r in rows if not rel or r["path"] == rel or r["path"].startswith(prefix)]
    return report


def report_drain_live(drain: dict) -> bool:
    """The drain status is of a drain that still runs (a stopped one's held markers are old)."""
    pid = drain.get("pid")
    return bool(pid) and _process_alive(pid)


def _drain_errors_under(drain: dict, rel: str) -> dict:
    """The drain's own errors at or below ``rel``: failed deletes (``delete KEY``) and
    records it could not read, beside the files in error that fsmeta records."""
    prefix = rel + "/" if rel else ""
    out = {}
    for what, code in (drain.get("errors") or {}).items():
        path = what.removeprefix("delete ")
        if not rel or path == rel or path.startswith(prefix):
            out[what] = code
    return out


# -- the drain's and the metrics endpoint's health (meta/gateway_status) -----------------------


def _utc(ns: int) -> datetime:
    return datetime.fromtimestamp(ns / 1e9, timezone.utc)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drain_health(gateway: dict, gateway_pid: int | None, drain_pid: int | None, now_ns: int) -> dict:
    """The drain's health, from what a live gateway's supervisor last published and who holds
    ``drain.lock``: a drain that is down is said to be down, never left blank."""
    supervised = gateway.get("drain") if gateway_pid and gateway.get("pid") == gateway_pid else None
    health = {"state": "not running", "summary": "", "pid": drain_pid, "supervised": supervised is not None,
              "restarts": 0, "last_exit": None, "last_error": None, "crash_looping_since": None,
              "restart_in_seconds": None}
    if supervised is None:
        if drain_pid:
            health["state"] = "running"
            health["summary"] = f"running (pid {drain_pid}, " + (
                "without a gateway: ckptfs drain)" if not gateway_pid else "not reported by the gateway)")
        else:
            health["summary"] = ("not running (no gateway)" if not gateway_pid
                                 else "not running (the gateway has not reported it)")
        return health
    state = supervised.get("state", "running")
    pid = drain_pid or supervised.get("pid")
    if state in ("running", "starting", "crash-looping") and pid and not drain_pid and not _process_alive(pid):
        pid = None  # exited since the supervisor last looked; it restarts it within a second or two
        state = "down" if state != "crash-looping" else state
    elif state == "running" and pid and not drain_pid:
        state = "starting"  # started, not yet holding drain.lock (or waiting for an older drain)
    restart_at = supervised.get("restart_at_ns")
    restart_in = max(0.0, (restart_at - now_ns) / 1e9) if restart_at and not pid else None
    since = supervised.get("crash_looping_since_ns")
    health.update(state=state, pid=pid, restarts=supervised.get("restarts", 0),
                  last_exit=supervised.get("last_exit"), last_error=supervised.get("last_error"),
                  crash_looping_since=_utc(since).isoformat(timespec="seconds") if since else None,
                  restart_in_seconds=restart_in)
    health["summary"] = _drain_summary(health, now_ns, since)
    return health


def _drain_process_now(health: dict) -> str:
    if health["pid"]:
        return f"{'starting' if health['state'] == 'starting' else 'running'} (pid {health['pid']})"
    if health["restart_in_seconds"] is not None:
        return f"restarting in {_seconds(health['restart_in_seconds'])}"
    return "restarting"


def _drain_summary(health: dict, now_ns: int, since_ns: int | None) -> str:
    now = _drain_process_now(health)
    last_error = f"; last error: {health['last_error']}" if health["last_error"] else ""
    if health["state"] == "crash-looping":
        since = _utc(since_ns)
        return (f"crash-looping since {since:%Y-%m-%d %H:%M:%S} UTC ({_seconds(_age(now_ns, since_ns))} ago), "
                f"{health['restarts']} restarts; {now}; last exit: {health['last_exit'] or 'unknown'}{last_error}")
    if health["state"] == "down":
        return f"down ({health['last_exit'] or 'exited'}, {now}){last_error}"
    if health["restarts"]:
        return (f"{now}; restarted {health['restarts']} time(s) since the mount, last exit: "
                f"{health['last_exit']}{last_error}")
    return now


def metrics_endpoint(gateway: dict, gateway_pid: int | None) -> dict | None:
    """The live gateway's metrics endpoint: its address, and whether it could be served."""
    if not gateway_pid or gateway.get("pid") != gateway_pid:
        return None
    return gateway.get("metrics")


def _metrics_line(endpoint: dict) -> str:
    if endpoint.get("serving"):
        return f"http://{endpoint['addr']}/metrics"
    if endpoint.get("serving") is None:
        return f"{endpoint['addr']}: not started yet"
    return (f"not served: {endpoint['addr']}: {endpoint.get('error')} (another mount on this host? "
            "give each mount its own --metrics-addr); the mount works without it")


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 90:
        return f"{value:.0f}s"
    if value < 5400:
        return f"{value / 60:.0f}m"
    return f"{value / 3600:.1f}h"


def render(report: dict, width: int = 80):
    """The report for people: a summary, then the checkpoint table (rich renderables).

    Long checkpoint paths are shortened in the middle (the checkpoint's own name is kept)
    so that a row fits ``width`` columns.
    """
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    rate = report["upload_rate_bytes_per_second"]
    cache = report["cache"]
    summary.add_row("bucket", str(report["bucket_url"]))
    summary.add_row("cache", f"{report['cache_dir']}  gateway pid {report['gateway_pid'] or '-'}  "
                             f"data path {report['data_path'] or '-'}  "
                             f"requests via {report['fuse_transport'] or '-'}")
    summary.add_row("drain", report["drain"]["summary"])
    if report["metrics_endpoint"]:
        summary.add_row("metrics", _metrics_line(report["metrics_endpoint"]))
    if report["records"] and report["records"]["unpublished"]:
        summary.add_row("records", f"{report['records']['unpublished']} in-flight record(s) not in the bucket yet "
                                   "(retrying): other nodes' markers may not wait for this node's files there")
    summary.add_row("backlog", f"{report['pending_files']} files, {human_bytes(report['pending_bytes'])}, "
                               f"{report['pending_deletes']} deletes; oldest waiting "
                               f"{_seconds(report['oldest_pending_age_seconds'])}")
    summary.add_row("drained", f"{report['uploaded_files']} files, {human_bytes(report['uploaded_bytes'])} since "
                               f"the drain started; now {human_bytes(rate) + '/s' if rate is not None else '-'}")
    summary.add_row("cache use", f"{human_bytes(cache['used_bytes'])} in cache files "
                                 f"({human_bytes(cache['dirty_bytes'])} not in the bucket yet); device "
                                 f"{human_bytes(cache['device_free_bytes'])} free of {human_bytes(cache['device_bytes'])}")
    if cache.get("max_bytes"):
        summary.add_row("cache cap", f"{human_bytes(cache['max_bytes'])}; clean files evicted above "
                                     f"{human_bytes(cache['high_watermark_bytes'])} down to "
                                     f"{human_bytes(cache['low_watermark_bytes'])}; {cache['evictions']} evicted "
                                     f"({human_bytes(cache['evicted_bytes'])}) since the gateway started")
    pressure = report["backpressure"]
    if pressure["waiting_writers"] or pressure["refused_writes"] or pressure["wait_seconds_total"]:
        summary.add_row("backpressure", f"{pressure['waiting_writers']} writer(s) waiting for cache space now "
                                        f"(longest {_seconds(pressure['longest_wait_seconds'])}); "
                                        f"{_seconds(pressure['wait_seconds_total'])} waited in all, "
                                        f"{pressure['refused_writes']} write(s) refused (ENOSPC)")
    for what, msg in report["retrying"].items():
        summary.add_row("retrying", f"{what}: {msg}")
    for path, err in report["errors"].items():
        summary.add_row("error", f"{path}: {err}")
    for path, held in report["held_markers"].items():
        lost = held.get("lost") or {}
        nodes = ", ".join(f"{n} (lost: not heard of since {lost[n][:19]} UTC)" if n in lost else n
                          for n in held["nodes"])
        summary.add_row("held", f"{path}: waits for node(s) {nodes} "
                                f"(since {_seconds((time.time_ns() - held['since_ns']) / 1e9)} ago)")
    if "checkpoints" in report:
        summary.add_row("columns", "DIRTY/UPL/DONE/ERR: files not sent, being sent, in the bucket, failing; "
                                   "WAIT: oldest pending; ETA: at the current rate")
    parts = [summary]
    if "checkpoints" in report:
        header = ("CHECKPOINT", "SIZE", "FILES", "DIRTY", "UPL", "DONE", "ERR", "WAIT", "ETA", "MARKER")
        cells = []
        for row in report["checkpoints"]:
            marker = "in bucket" if row["marker_in_bucket"] else ("local" if row["complete"] else "none")
            cells.append([row["path"], human_bytes(row["bytes"]), str(row["files"]), str(row["dirty"]),
                          str(row["uploading"]), str(row["durable"]), str(row["errors"]),
                          _seconds(row["oldest_pending_age_seconds"]), _seconds(row["eta_seconds"]), marker])
        # Every column but the path keeps its width; the path gets the rest, shortened in the middle.
        fixed = sum(max(len(header[i]), *(len(c[i]) for c in cells)) + 2 for i in range(1, len(header))) if cells else 0
        table = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 2, 0, 0))
        for name in header:
            table.add_column(name, justify="left" if name in ("CHECKPOINT", "MARKER") else "right", no_wrap=True)
        for c in cells:
            table.add_row(elide_path(c[0], max(16, width - fixed - 1)), *c[1:])
        parts += ["", table if cells else "no checkpoints (see [lifecycle] checkpoints)"]
    return Group(*parts)


def cmd_status(args: argparse.Namespace, argv: list[str]) -> int:
    if args.cache_dir:
        cache, rel = CacheDir(args.cache_dir), ""
    else:
        try:
            _, cache_dir, rel = find_mount(args.mountpoint or ".")
        except NotOnMount as exc:
            print(f"ckptfs: {exc}", file=sys.stderr)
            return 2
        cache = CacheDir(cache_dir)
    if not cache.has_meta():
        print(f"ckptfs: cache directory {cache.root}: no ckptfs cache here (never mounted?)", file=sys.stderr)
        return 2

    def report() -> dict:
        return collect(cache, rel, by_checkpoint=args.by_checkpoint)

    console = Console(highlight=False)
    if not args.watch:
        if args.json:
            print(json.dumps(report(), indent=2))
        else:
            console.print(render(report(), console.width))
        return 0
    try:
        if args.json:
            while True:
                print(json.dumps(report()), flush=True)
                time.sleep(args.interval)
        with Live(render(report(), console.width), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(report(), console.width), refresh=True)
    except KeyboardInterrupt:
        return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("wait-durable", help="block until everything under PATH is durable in the bucket")
    p.add_argument("path")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--local", action="store_true",
                   help="wait for this node's files only, not for the other nodes' files under PATH")
    p.set_defaults(func=cmd_wait_durable)

    p = sub.add_parser("status", help="drain backlog, errors and cache use of a mount or cache directory")
    p.add_argument("mountpoint", nargs="?")
    p.add_argument("--cache-dir")
    p.add_argument("--json", action="store_true", help="machine-readable (fields: see docs/OPERATIONS.md)")
    p.add_argument("--by-checkpoint", action="store_true", help="one row per checkpoint directory")
    p.add_argument("--watch", action="store_true", help="refresh until interrupted (with --json: a line each)")
    p.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_status)
