"""``ckptfs prefetch PATH``, ``ckptfs evict PATH`` and ``ckptfs verify PATH``: the read path
and the cache from the command line.

``prefetch`` warms the cache before a resume: every regular file at or below PATH (a path on
a ckptfs mount) is fetched whole by the gateway, in parallel. The CLI asks for each file by
reading its ``user.ckptfs.prefetch`` extended attribute, which the gateway answers only once
the file is in the cache, checked and cached-clean (``gateway/fetch.py``); the gateway's
``[read] concurrency`` bounds the GETs in flight across all of them. ``--json`` prints one
object: ``files``, ``bytes``, ``fetched`` (bytes asked from the bucket; the rest was cached
already), ``seconds``, ``gbps`` and ``errors`` (path -> message). Exit 1 if any file failed.

``evict`` frees the cache space of a file or checkpoint directory now, rather than waiting
for the cap's LRU: it reads each regular file's ``user.ckptfs.evict`` attribute, which drops
the file's cache copy if it is clean (in the bucket, no upload pending), not open and not a
commit marker. An evicted file stays visible and is fetched again when read. ``--json``
prints ``files``, ``evicted`` (files now in the bucket only), ``evicted_bytes``, ``kept``
(paths left in the cache: dirty, open or markers) and ``errors``. Exit 1 on errors only; a
kept file is not an error.

``verify`` re-reads what the bucket holds under PATH and checks each object against its
``x-amz-meta-blake3``, against the hash fsmeta recorded and against the cached copy
(``drain/verify.py``). It talks to the bucket directly, with the settings the cache directory
remembers (like ``ckptfs fsck --bucket``). ``--json`` prints ``{"ok", "checked": [{"key",
"size", "status", "detail"}]}``. Exit 1 if anything is mismatched or missing.

All three exit 2 when PATH is not on a ckptfs mount.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from ckptfs.gateway.mountpoint import NotOnMount, find_mount
from ckptfs.gateway.xattrs import EVICT_XATTR, PREFETCH_XATTR

from .common import human_bytes

PREFETCH_JOBS = 16  # files asked for at once (each holds a gateway worker thread while it waits)


def files_under(path: str) -> list[tuple[str, int]]:
    """(path, size) of every regular file at or below ``path`` (symlinks not followed)."""
    if not os.path.isdir(path):
        return [(path, os.stat(path).st_size)]
    out = []
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode):
                out.append((full, st.st_size))
    return out


def prefetch(path: str, *, jobs: int = PREFETCH_JOBS, on_file=None) -> dict:
    """Have the gateway fetch every file below ``path`` into its cache; a summary."""
    files = files_under(path)
    start = time.monotonic()
    fetched = 0
    errors: dict[str, str] = {}

    def one(item: tuple[str, int]) -> int:
        answer = os.getxattr(item[0], os.fsdecode(PREFETCH_XATTR))
        return int(json.loads(answer)["fetched"])

    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(files)))) as pool:
        futures = {pool.submit(one, item): item for item in files}
        for future in as_completed(futures):
            file_path, size = futures[future]
            try:
                fetched += future.result()
            except OSError as exc:
                errors[file_path] = exc.strerror or str(exc)
            if on_file is not None:
                on_file(size)
    seconds = time.monotonic() - start
    total = sum(size for _, size in files)
    return {"files": len(files), "bytes": total, "fetched": fetched, "seconds": round(seconds, 3),
            "gbps": round(total / seconds / 1e9, 3) if seconds > 0 else None, "errors": errors}


def _print_json(summary: dict) -> None:
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _print_errors(errors: dict[str, str]) -> None:
    for file_path, message in sorted(errors.items()):
        print(f"  {file_path}: {message}", file=sys.stderr)


def _on_a_mount(command: str, path: str) -> bool:
    try:
        find_mount(path)
    except NotOnMount as exc:
        print(f"ckptfs {command}: {exc}", file=sys.stderr)
        return False
    return True


def cmd_prefetch(args: argparse.Namespace, argv: list[str]) -> int:
    if not _on_a_mount("prefetch", args.path):
        return 2
    if not args.json and sys.stderr.isatty():
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), TimeRemainingColumn(), console=Console(file=sys.stderr)) as bar:
            task = bar.add_task("prefetch", total=sum(size for _, size in files_under(args.path)))
            summary = prefetch(args.path, jobs=args.jobs, on_file=lambda n: bar.advance(task, n))
    else:
        summary = prefetch(args.path, jobs=args.jobs)
    if args.json:
        _print_json(summary)
    else:
        rate = f"{summary['gbps']:.2f} GB/s" if summary["gbps"] is not None else "-"
        print(f"prefetch: {summary['files']} files, {human_bytes(summary['bytes'])} "
              f"({human_bytes(summary['fetched'])} from the bucket) in {summary['seconds']:.2f} s, {rate}")
        _print_errors(summary["errors"])
    return 1 if summary["errors"] else 0


def evict(path: str) -> dict:
    """Have the gateway drop the cache copy of every evictable file below ``path``; a summary."""
    evicted, evicted_bytes = 0, 0
    kept: list[str] = []
    errors: dict[str, str] = {}
    files = files_under(path)
    for file_path, _ in files:
        try:
            answer = json.loads(os.getxattr(file_path, os.fsdecode(EVICT_XATTR)))
        except OSError as exc:
            errors[file_path] = exc.strerror or str(exc)
            continue
        if answer["evicted"]:
            evicted += 1
            evicted_bytes += int(answer["bytes"])
        else:
            kept.append(file_path)
    return {"files": len(files), "evicted": evicted, "evicted_bytes": evicted_bytes,
            "kept": kept, "errors": errors}


def cmd_evict(args: argparse.Namespace, argv: list[str]) -> int:
    if not _on_a_mount("evict", args.path):
        return 2
    summary = evict(args.path)
    if args.json:
        _print_json(summary)
    else:
        print(f"evict: {summary['files']} files, {summary['evicted']} in the bucket only "
              f"({human_bytes(summary['evicted_bytes'])}), {len(summary['kept'])} kept in the cache "
              "(not in the bucket yet, open, or a commit marker)")
        _print_errors(summary["errors"])
    return 1 if summary["errors"] else 0


def run_verify(path: str, *, concurrency: int = 8) -> list:
    """Check the bucket's objects under ``path`` (on a ckptfs mount). Raises NotOnMount."""
    # Imported here: the S3 client costs ~0.5 s of start-up that prefetch does not need.
    import trio

    from ckptfs.drain import verify as bucket_verify
    from ckptfs.drain.factory import open_store_for
    from ckptfs.fsmeta.layout import CacheDir
    from ckptfs.fsmeta.settings import Settings

    _, cache_dir, rel = find_mount(path)
    cache = CacheDir(cache_dir)
    meta = cache.open_meta()
    try:
        settings = Settings.from_json(meta.get_settings() or {})

        async def run() -> list[bucket_verify.Checked]:
            async with open_store_for(settings) as store:
                return await bucket_verify.verify_tree(cache, meta, store, rel, concurrency=concurrency)

        return trio.run(run)
    finally:
        meta.close()


def cmd_verify(args: argparse.Namespace, argv: list[str]) -> int:
    from ckptfs.drain import verify as bucket_verify

    try:
        checked = run_verify(args.path, concurrency=args.jobs)
    except NotOnMount as exc:
        print(f"ckptfs verify: {exc}", file=sys.stderr)
        return 2
    problems = [c for c in checked if c.status in bucket_verify.PROBLEMS]
    if args.json:
        json.dump({"ok": not problems, "checked": [c.to_json() for c in checked]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for c in problems:
            print(f"{c.status}: {c.key}: {c.detail}")
        unchecked = sum(c.status == bucket_verify.UNCHECKED for c in checked)
        print(f"verify: {len(checked)} objects, {len(problems)} problems"
              + (f", {unchecked} without a blake3 to check" if unchecked else ""))
    return 1 if problems else 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefetch", help="fetch a file or checkpoint directory into the cache, in parallel")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--jobs", type=int, default=PREFETCH_JOBS, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_prefetch)

    p = sub.add_parser("evict", help="free the cache space of a file or checkpoint directory now (it stays readable)")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=cmd_evict)

    p = sub.add_parser("verify", help="re-read the bucket's objects under PATH and check their blake3")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--jobs", type=int, default=8, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_verify)
