"""``ckptfs lifecycle plan|apply`` and ``ckptfs promote``.

::

    ckptfs lifecycle plan  [BUCKET_URL] [--config FILE] [--endpoint-url URL] [--json] [--cache-dir DIR]
    ckptfs lifecycle apply [BUCKET_URL] [--config FILE] [--endpoint-url URL] [--json] [--cache-dir DIR]
                           [--direct] [--every DURATION] [--dry-run]
    ckptfs promote PATH [--undo] [--bucket BUCKET_URL] [--config FILE] [--endpoint-url URL]

Exit codes: 0 success; 1 an object-store error or a failed action; 2 a bad
setting or usage (the message names the setting).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import trio

from ckptfs.drain.factory import open_store
from ckptfs.drain.store import StoreError
from ckptfs.fsmeta.layout import CacheDir
from ckptfs.fsmeta.settings import (
    ConfigError,
    Settings,
    build_settings,
    parse_store_url,
)
from ckptfs.gateway.mountpoint import NotOnMount, find_mount
from ckptfs.lifecycle.executor import CacheMismatch, read_local_pending, run_once
from ckptfs.lifecycle.pins import (
    PinError,
    add_pin,
    normalize_pin_path,
    pin_key,
    remove_pin,
)
from ckptfs.lifecycle.render import plan_to_json, render_table
from ckptfs.lifecycle.rules import (
    LifecycleConfigError,
    rules_from_table,
    validate_rules,
)

log = logging.getLogger("ckptfs.lifecycle")

DEFAULT_CONCURRENCY = 16  # parallel requests (tag reads, tagging, copies)
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)", re.IGNORECASE)
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class UsageError(Exception):
    """Bad arguments or settings: exit code 2."""


# --------------------------------------------------------------------------- parsing helpers


def parse_duration(text: str, *, name: str = "--every") -> float:
    """``1h``, ``30m``, ``1h30m``, ``90s``, ``2d``, ``1w`` or plain seconds -> seconds."""
    raw = str(text).strip().replace(" ", "")
    pos, total = 0, 0.0
    if not raw:
        raise UsageError(f"{name}: expected a duration such as 1h, 30m or 90s, got {text!r}")
    while pos < len(raw):
        m = _DURATION_RE.match(raw, pos)
        if m is None or m.end() == pos:
            raise UsageError(f"{name}: expected a duration such as 1h, 30m or 90s, got {text!r}")
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2).lower()]
        pos = m.end()
    if total <= 0:
        raise UsageError(f"{name}: must be longer than 0 seconds, got {text!r}")
    return total


def parse_now(text: str | None) -> datetime:
    """``--now`` (hidden, for tests and what-if runs): an ISO 8601 time, or an
    offset from the real clock such as ``+3d`` / ``-12h``."""
    real = datetime.now(timezone.utc)
    if text is None:
        return real
    raw = text.strip()
    if raw[:1] in "+-":
        sign = -1 if raw[0] == "-" else 1
        return real + sign * timedelta(seconds=parse_duration(raw[1:], name="--now"))
    try:
        when = datetime.fromisoformat(raw)
    except ValueError:
        raise UsageError(f"--now: expected an ISO 8601 time or an offset like +3d, got {text!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def terminal_width() -> int:
    return max(shutil.get_terminal_size(fallback=(80, 24)).columns, 40)


# --------------------------------------------------------------------------- settings


@dataclass
class Context:
    bucket_url: str
    endpoint_url: str | None
    region: str | None
    checksum: str
    sign_payload: bool
    rules: object  # LifecycleRules
    cache_dir: str | None  # consulted for pending keys

    def open_store(self):
        return open_store(
            self.bucket_url,
            endpoint_url=self.endpoint_url,
            region=self.region,
            checksum=self.checksum,
            sign_payload=self.sign_payload,
            concurrency=DEFAULT_CONCURRENCY,
        )

    def pending_source(self):
        if self.cache_dir is None:
            return None

        cache_dir, url = self.cache_dir, self.bucket_url
        return lambda: read_local_pending(cache_dir, url)


def _settings(config: str | None, overrides: dict):
    try:
        return build_settings(config, overrides)
    except ConfigError as exc:
        where = f"{config}: " if config and not str(exc).startswith("config:") else ""
        raise UsageError(f"{where}{exc}") from None


def load_context(args: argparse.Namespace) -> Context:
    explicit_cache = getattr(args, "cache_dir", None)
    settings = _settings(
        args.config,
        {"bucket_url": args.bucket_url, "endpoint_url": args.endpoint_url,
         "cache_dir": os.path.abspath(explicit_cache) if explicit_cache else None},
    )
    if not settings.bucket_url:
        raise UsageError("bucket_url: not set; give BUCKET_URL or set bucket_url in the --config file")
    try:

        parse_store_url(settings.bucket_url)
    except ValueError as exc:
        raise UsageError(f"bucket_url: {exc}") from None
    try:
        rules = rules_from_table(settings.lifecycle or {})
    except LifecycleConfigError as exc:
        where = f"{args.config}: " if args.config else ""
        raise UsageError(f"{where}{exc}") from None
    for warning in validate_rules(rules):
        print(f"ckptfs: warning: {warning}", file=sys.stderr)

    cache_dir: str | None = None
    if explicit_cache:
        if not CacheDir(settings.cache_dir).has_meta():
            raise UsageError(f"--cache-dir: {settings.cache_dir} is not a ckptfs cache directory (no meta/data.mdb)")
        cache_dir = settings.cache_dir
    elif CacheDir(settings.cache_dir).has_meta():
        cache_dir = settings.cache_dir
    if cache_dir is not None:

        try:
            pending = read_local_pending(cache_dir, settings.bucket_url)
            log.info("local cache %s: %d pending key(s) protected", cache_dir, len(pending))
        except CacheMismatch as exc:
            if explicit_cache:
                raise UsageError(f"--cache-dir: {exc}") from None
            print(f"ckptfs: warning: {exc}", file=sys.stderr)
            cache_dir = None
        except Exception as exc:  # noqa: BLE001 - lmdb errors, permissions
            if explicit_cache:
                raise UsageError(f"--cache-dir: cannot read {cache_dir}: {exc}") from None
            print(f"ckptfs: warning: cannot read the cache {cache_dir} ({exc}); no pending keys", file=sys.stderr)
            cache_dir = None
    return Context(
        bucket_url=settings.bucket_url,
        endpoint_url=settings.endpoint_url,
        region=settings.region,
        checksum=settings.checksum,
        sign_payload=bool(settings.sign_payload),
        rules=rules,
        cache_dir=cache_dir,
    )


# --------------------------------------------------------------------------- output


def _entries_json(inputs, report, include_keys: bool) -> list[dict]:
    out = plan_to_json(inputs.plan, include_keys=include_keys)
    if report is not None:
        for item in out:
            result = report.result_for(item["path"])
            item["result"] = result.to_json() if result is not None else None
    return out


def _print_run(args, inputs, report, *, compact: bool = False) -> None:
    if args.json:
        data = _entries_json(inputs, report, args.keys)
        print(json.dumps(data, separators=(",", ":")) if compact else json.dumps(data, indent=2))
        for warning in inputs.plan.warnings:
            print(f"ckptfs: warning: {warning}", file=sys.stderr)
    else:
        sys.stdout.write(render_table(inputs.plan, width=terminal_width()))
        if report is not None:
            print()
            print(f"{'applied' if report.ok else 'applied with errors'}: {report.summary_line()}")
            for result in report.results:
                if result.status in ("failed", "skipped"):
                    print(f"  {result.status}: {result.path}: {result.detail}")
    sys.stdout.flush()


# --------------------------------------------------------------------------- lifecycle plan / apply


def _quiet_http_logs() -> None:
    # httpx logs every request at INFO; the actions are what people need to see.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def cmd_lifecycle(args: argparse.Namespace, argv: list[str]) -> int:
    _quiet_http_logs()
    try:
        ctx = load_context(args)
        now_text = args.now
        parse_now(now_text)  # validate early
        apply = args.lifecycle_command == "apply" and not getattr(args, "dry_run", False)
        every = parse_duration(args.every) if getattr(args, "every", None) else None
    except UsageError as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return EXIT_USAGE


    try:
        return trio.run(_lifecycle_main, args, ctx, apply, every)
    except KeyboardInterrupt:
        return 130


async def _lifecycle_main(args, ctx: Context, apply: bool, every: float | None) -> int:
    stopping = trio.Event()
    status = EXIT_OK

    async def watch_signals(cancel_scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if not stopping.is_set():
                    log.info("%s: stopping after the current checkpoint", signal.Signals(signum).name)
                    stopping.set()
                else:
                    cancel_scope.cancel()
                    return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_signals, nursery.cancel_scope)
        run = 0
        store = ctx.open_store()
        try:
            async with store:
                await store.check_access()
                while True:
                    run += 1
                    if every is not None:
                        log.info("lifecycle run %d on %s", run, store.url)
                    try:
                        inputs, report = await run_once(
                            store, ctx.rules, parse_now(args.now), apply=apply, direct=getattr(args, "direct", False),
                            pending=ctx.pending_source(), should_stop=stopping.is_set,
                        )
                    except StoreError as exc:
                        print(f"ckptfs: {exc}", file=sys.stderr)
                        status = EXIT_FAILED
                        if every is None:
                            break
                    else:
                        _print_run(args, inputs, report, compact=every is not None)
                        status = EXIT_OK if report is None or report.ok else EXIT_FAILED
                    if every is None or stopping.is_set():
                        break
                    log.info("next lifecycle run in %s", _format_seconds(every))
                    with trio.move_on_after(every):
                        await stopping.wait()
                    if stopping.is_set():
                        break
        except StoreError as exc:
            print(f"ckptfs: {exc}", file=sys.stderr)
            status = EXIT_FAILED
        nursery.cancel_scope.cancel()
    if stopping.is_set() and every is not None:
        log.info("lifecycle loop stopped after %d run(s)", run)
        return EXIT_OK if status == EXIT_OK else status
    return status


def _format_seconds(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


# --------------------------------------------------------------------------- promote


@dataclass
class PinTarget:
    ctx_bucket_url: str
    endpoint_url: str | None
    region: str | None
    checksum: str
    sign_payload: bool
    path: str  # relative to the store prefix


def _url_relative(url: str, store_url: str) -> str | None:
    """``url`` relative to ``store_url``, or None if it is not inside it."""

    u, s = parse_store_url(url), parse_store_url(store_url)
    if u.scheme != s.scheme:
        return None
    if u.scheme == "s3":
        if u.bucket != s.bucket:
            return None
        full, base = u.prefix, s.prefix  # "a/b/" forms
    else:
        full, base = u.path.rstrip("/") + "/", s.path.rstrip("/") + "/"
    if not full.startswith(base):
        return None
    return full[len(base) :].strip("/")


def resolve_pin_target(args: argparse.Namespace) -> PinTarget:
    path = args.path
    config_settings = None
    if args.config or args.bucket:
        config_settings = _settings(args.config, {"bucket_url": args.bucket, "endpoint_url": args.endpoint_url})

    def from_settings(settings, rel: str) -> PinTarget:
        return PinTarget(settings.bucket_url, args.endpoint_url or settings.endpoint_url, settings.region,
                         settings.checksum, bool(settings.sign_payload), rel)

    if "://" in path:
        if config_settings is None or not config_settings.bucket_url:
            raise UsageError(
                f"{path}: cannot tell where the store prefix ends; pass --bucket s3://bucket/prefix "
                "(the URL ckptfs is mounted with) or --config with bucket_url"
            )
        try:
            rel = _url_relative(path, config_settings.bucket_url)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if rel is None:
            raise UsageError(f"{path} is not inside {config_settings.bucket_url}")
        return from_settings(config_settings, rel)

    if not args.bucket:

        try:
            _, cache_dir, rel = find_mount(path)
        except NotOnMount as exc:
            if config_settings is None or not config_settings.bucket_url:
                raise UsageError(f"{exc}; pass a bucket path with --bucket s3://bucket/prefix or --config") from None
        else:
            meta = CacheDir(cache_dir).open_meta()
            try:
                stored = meta.get_settings() or {}
            finally:
                meta.close()
            if not stored.get("bucket_url"):
                raise UsageError(f"{cache_dir}: the cache of this mount records no bucket URL")
            return from_settings(Settings.from_json(stored), rel)
    if config_settings is None or not config_settings.bucket_url:
        raise UsageError("bucket_url: not set; pass --bucket s3://bucket/prefix or a --config with bucket_url")
    return from_settings(config_settings, path)


def cmd_promote(args: argparse.Namespace, argv: list[str]) -> int:
    _quiet_http_logs()
    try:
        target = resolve_pin_target(args)
        rel = normalize_pin_path(target.path)
    except (UsageError, PinError) as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return EXIT_USAGE

    async def work() -> int:
        store = open_store(target.ctx_bucket_url, endpoint_url=target.endpoint_url, region=target.region,
                           checksum=target.checksum, sign_payload=target.sign_payload)
        async with store:
            where = f"{store.url.rstrip('/')}/{pin_key(rel)}"
            if args.undo:
                if await remove_pin(store, rel):
                    print(f"unpinned {rel} ({where} deleted)")
                else:
                    print(f"{rel} was not pinned")
                return EXIT_OK
            exists = await store.head(rel) is not None or await store.holds_any(rel + "/")
            if await add_pin(store, rel):
                print(f"pinned {rel} ({where}): lifecycle keeps it, untouched, until 'ckptfs promote --undo'")
            else:
                print(f"{rel} is already pinned")
            if not exists:
                print(f"ckptfs: warning: nothing in {store.url} under {rel} yet; the pin applies once it appears",
                      file=sys.stderr)
            return EXIT_OK


    try:
        return trio.run(work)
    except StoreError as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return EXIT_FAILED


# --------------------------------------------------------------------------- argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("bucket_url", nargs="?", help="s3://bucket[/prefix] or file:///abs/dir (default: bucket_url of --config)")
    common.add_argument("--config", help="TOML settings file; its [lifecycle] table holds the rules")
    common.add_argument("--endpoint-url", help="S3 endpoint, e.g. http://127.0.0.1:7480")
    common.add_argument("--json", action="store_true", help="one JSON object per checkpoint (a list)")
    common.add_argument("--keys", action="store_true", help="with --json: include the keys to delete / transition")
    common.add_argument("--cache-dir", help="a local ckptfs cache: its pending (not yet durable) keys are left alone "
                                            "(default: the config's [cache] dir, if it exists)")
    common.add_argument("--now", help=argparse.SUPPRESS)

    p = sub.add_parser("lifecycle", help="checkpoint retention and tiering: plan (dry run) or apply")
    lsub = p.add_subparsers(dest="lifecycle_command", required=True)
    lp = lsub.add_parser("plan", parents=[common], help="show what apply would do; changes nothing")
    lp.set_defaults(func=cmd_lifecycle)
    la = lsub.add_parser("apply", parents=[common], help="delete and tier checkpoints as the rules say")
    la.add_argument("--direct", action="store_true",
                    help="change storage classes by copying objects in place now, instead of tagging them "
                         "for bucket lifecycle rules (always so on file:// stores)")
    la.add_argument("--every", metavar="DURATION", help="run again every DURATION (e.g. 1h, 30m) until SIGTERM")
    la.add_argument("--dry-run", action="store_true", help="only plan (same as 'lifecycle plan')")
    la.set_defaults(func=cmd_lifecycle)

    p = sub.add_parser("promote", help="pin a checkpoint: lifecycle never deletes or tiers it")
    p.add_argument("path", help="a path on a ckptfs mount, a bucket URL inside --bucket, or a path relative to --bucket")
    p.add_argument("--undo", action="store_true", help="remove the pin")
    p.add_argument("--bucket", help="the store's bucket URL (s3://bucket/prefix or file:///dir)")
    p.add_argument("--config", help="TOML settings file (bucket_url, endpoint_url)")
    p.add_argument("--endpoint-url", help="S3 endpoint")
    p.set_defaults(func=cmd_promote)


__all__ = ["add_commands", "cmd_lifecycle", "cmd_promote", "parse_duration", "parse_now"]
