"""``ckptfs fsck CACHE_DIR [--bucket] [--repair] [--json]``: is this cache consistent?

Checks fsmeta's invariants, the cache files against the inodes and, with ``--bucket``, the
bucket against fsmeta (see docs/OPERATIONS.md, "Consistency check", for each finding).
Checking only reads, so it may run while a gateway or drain works on the cache (LMDB readers
see one committed state); ``--repair`` refuses while either runs.

``--json`` prints one object: ``cache_dir``, ``bucket_url`` (null without ``--bucket``),
``repair`` (bool), ``ok`` (bool) and ``findings``: a list of objects with ``kind``, ``path``
(file system path, relative to the mount root, or null), ``key`` (bucket key or null),
``ino``, ``cache_file``, ``upload_id``, ``detail``, ``repairable`` and ``repaired``.

Exit status: 0 when nothing is wrong after the run (clean, or everything found was repaired,
or only informational findings); 1 when a problem remains; 2 when it cannot run (no cache
there, or ``--repair`` while a gateway or drain holds the cache).
"""

from __future__ import annotations

import argparse
import json
import sys

import trio
from rich.console import Console
from rich.table import Table

from ckptfs.drain import check as bucket_check
from ckptfs.drain.factory import open_store_for
from ckptfs.fsmeta import check
from ckptfs.fsmeta.layout import CacheDir, NoCacheHere
from ckptfs.fsmeta.settings import Settings
from ckptfs.gateway.listing import hidden_objects
from ckptfs.lifecycle.pins import is_reserved_key


def run_fsck(cache_dir: str, *, bucket: bool = False, repair: bool = False) -> tuple[list[check.Finding], str | None]:
    """Check (and repair) a cache directory: (findings, bucket URL or None). Raises
    :class:`NoCacheHere`; the caller makes sure nothing holds the cache before ``repair``."""
    cache = CacheDir(cache_dir)
    meta = cache.open_meta()
    try:
        live = cache.gateway_pid() is not None
        findings = [check.Finding(check.INVARIANT, problem) for problem in check.fsmeta_problems(meta)]
        with meta.read() as txn:
            findings += check.cache_file_findings(txn, cache.data_dir, skip_open=live)
        if repair:
            for finding in findings:
                if finding.repairable:
                    finding.repaired = check.repair_cache_file(finding, meta, cache.data_dir)
        bucket_url = None
        if bucket:
            settings = Settings.from_json(meta.get_settings() or {})
            bucket_url = settings.bucket_url

            async def compare() -> list[check.Finding]:
                async with open_store_for(settings) as store:
                    found = await bucket_check.bucket_findings(cache, meta, store)
                    found += await _hidden_object_findings(store)
                    if repair:
                        for finding in found:
                            if finding.repairable:
                                finding.repaired = await bucket_check.repair(finding, meta, store)
                    return found

            findings += trio.run(compare)
        if repair:
            meta.sync()
        return findings, bucket_url
    finally:
        meta.close()


async def _hidden_object_findings(store) -> list[check.Finding]:
    """Objects the bucket holds under a key that no mount shows (informational: a checkpoint
    another tool wrote there is invisible through the mount, which should be said somewhere)."""
    keys = []
    async for page in store.list_pages(""):
        keys.extend(obj.key for obj in page.objects if not is_reserved_key(obj.key))
    return [check.Finding(bucket_check.HIDDEN_OBJECT, why, key=key) for key, why in hidden_objects(keys)]


def is_problem(finding: check.Finding) -> bool:
    return not finding.repaired and finding.kind not in bucket_check.INFORMATIONAL


def _print_table(findings: list[check.Finding], repair: bool, out) -> None:
    console = Console(file=out, soft_wrap=True)
    if not findings:
        console.print("fsck: clean", markup=False, highlight=False)
        return
    table = Table("kind", "where", "detail", "status")
    for f in findings:
        where = f.path or f.key or f.cache_file or (f"ino {f.ino}" if f.ino is not None else "")
        if f.repaired:
            status = "repaired"
        elif f.kind in bucket_check.INFORMATIONAL:
            status = "info"
        elif f.repairable:
            status = "repairable" if not repair else "NOT repaired"
        else:
            status = "needs attention"
        table.add_row(f.kind, where, f.detail, status)
    console.print(table)
    remaining = sum(is_problem(f) for f in findings)
    repaired = sum(f.repaired for f in findings)
    line = f"fsck: {len(findings)} findings, {repaired} repaired, {remaining} problems remain"
    if remaining and not repair and any(f.repairable for f in findings if is_problem(f)):
        line += " (--repair fixes those marked repairable)"
    console.print(line, markup=False, highlight=False)


def cmd_fsck(args: argparse.Namespace, argv: list[str]) -> int:
    cache = CacheDir(args.cache_dir)
    if args.repair:
        holders = [f"{what} (pid {pid})" for what, pid in (("a gateway", cache.gateway_pid()),
                                                            ("a drain", cache.drain_pid())) if pid]
        if holders:
            print(f"ckptfs fsck: {' and '.join(holders)} holds {cache.root}; stop it before --repair "
                  "(checking without --repair is safe meanwhile)", file=sys.stderr)
            return 2
    try:
        findings, bucket_url = run_fsck(args.cache_dir, bucket=args.bucket, repair=args.repair)
    except NoCacheHere as exc:
        print(f"ckptfs fsck: {exc}", file=sys.stderr)
        return 2
    ok = not any(is_problem(f) for f in findings)
    if args.json:
        json.dump({"cache_dir": cache.root, "bucket_url": bucket_url, "repair": args.repair, "ok": ok,
                   "findings": [f.to_json() for f in findings]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_table(findings, args.repair, sys.stdout)
    return 0 if ok else 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fsck", help="check a cache directory (and its bucket) for consistency; --repair what is safe")
    p.add_argument("cache_dir", metavar="CACHE_DIR")
    p.add_argument("--bucket", action="store_true", help="also compare the bucket with fsmeta")
    p.add_argument("--repair", action="store_true",
                   help="fix what is safe (refused while a gateway or drain holds the cache)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=cmd_fsck)
