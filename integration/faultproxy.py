"""A fault-injecting HTTP/1.1 proxy for S3 traffic on loopback (tests and benchmarks).

It sits between a client (the ckptfs drain, boto3, ...) and an S3 endpoint
(radosgw), speaks plain HTTP/1.1 with keep-alive on both sides, classifies
every request as an S3 operation (``UploadPart``, ``CompleteMultipartUpload``,
``PutObject``, ...) and can, configured at runtime from another thread:

* answer with an S3 error instead of forwarding (``fail``: 503 SlowDown, 500,
  403 AccessDenied, ... for a fraction of the requests or a number of them);
* reset the client connection (RST) after part of the request body (``reset``);
* cut a response body short: forward its head and part of its body, then close or reset
  the client connection (``cut``);
* delay a request before forwarding it (``stall``);
* limit the bandwidth of request bodies (uploads) and/or response bodies,
  shared by all connections (``set_bandwidth``);
* hold a request before it is forwarded, or hold the server's response after
  the server has executed the request, until the test releases it (``hold``):
  e.g. hold the response of CompleteMultipartUpload, ``kill -9`` the client,
  release;
* count and log every request (op, part number, upload id, status, bytes,
  timings, injected fault): ``counts()``, ``records()``, ``in_flight()``.

Usage::

    with FaultProxy("http://127.0.0.1:7480") as proxy:      # starts a thread
        client = boto3.client("s3", endpoint_url=proxy.url, ...)
        proxy.set_bandwidth(up=10 * MiB)
        rule = proxy.fail("UploadPart", status=503, code="SlowDown", fraction=0.3)
        hold = proxy.hold("CompleteMultipartUpload", when="response")
        hold.wait_held(30); ...; hold.release()
        proxy.counts()["UploadPart"]

Signatures stay valid: the proxy forwards the request line and headers
unchanged (except that it answers ``Expect: 100-continue`` itself), so
SigV4-signed requests (the Host header included) reach the server as sent.

``python -m integration.faultproxy --upstream URL [--port N] [--up-mibps X]
[--error-rate F]`` runs one by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import random
import socket
import struct
import threading
import time
from collections.abc import Iterable
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["FaultProxy", "Rule", "Hold", "RequestRecord", "classify"]

MiB = 1 << 20
CHUNK = 64 * 1024
HEAD_LIMIT = 64 * 1024


# --------------------------------------------------------------------------
# request classification


def classify(method: str, path: str, query: dict[str, list[str]], headers: dict[str, str]) -> str:
    """S3 operation name of a path-style request."""
    parts = unquote(path).lstrip("/").split("/", 1)
    has_key = len(parts) == 2 and parts[1] != ""
    q = query
    if method == "PUT":
        if "partNumber" in q and "uploadId" in q:
            return "UploadPartCopy" if "x-amz-copy-source" in headers else "UploadPart"
        if "tagging" in q:
            return "PutObjectTagging" if has_key else "PutBucketTagging"
        if "lifecycle" in q:
            return "PutBucketLifecycleConfiguration"
        if not has_key:
            return "CreateBucket"
        return "CopyObject" if "x-amz-copy-source" in headers else "PutObject"
    if method == "POST":
        if "uploads" in q:
            return "CreateMultipartUpload"
        if "uploadId" in q:
            return "CompleteMultipartUpload"
        if "delete" in q:
            return "DeleteObjects"
        return "Post"
    if method == "DELETE":
        if "uploadId" in q:
            return "AbortMultipartUpload"
        if "lifecycle" in q:
            return "DeleteBucketLifecycle"
        if "tagging" in q:
            return "DeleteObjectTagging"
        return "DeleteObject" if has_key else "DeleteBucket"
    if method == "GET":
        if "uploadId" in q:
            return "ListParts"
        if not has_key:
            if "uploads" in q:
                return "ListMultipartUploads"
            if "versions" in q:
                return "ListObjectVersions"
            if "lifecycle" in q:
                return "GetBucketLifecycleConfiguration"
            if parts[0] == "":
                return "ListBuckets"
            return "ListObjects"
        if "tagging" in q:
            return "GetObjectTagging"
        return "GetObject"
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    return method


# --------------------------------------------------------------------------
# records and rules


@dataclasses.dataclass
class RequestRecord:
    id: int
    op: str
    method: str
    path: str
    key: str
    part_number: int | None
    upload_id: str | None
    content_length: int | None
    t_start: float  #: time.monotonic() when the request head arrived
    t_end: float | None = None
    status: int | None = None  #: status sent to the client (None: none was sent)
    bytes_in: int = 0  #: request body bytes received from the client
    bytes_out: int = 0  #: response body bytes sent to the client
    fault: str | None = None  #: "error 503 SlowDown", "reset", "stall 2.0", "hold-request", ...
    forwarded: bool = False  #: the request (head) reached the server
    outcome: str = "pending"  #: ok | injected | client-gone | upstream-error | reset

    @property
    def done(self) -> bool:
        return self.t_end is not None


@dataclasses.dataclass
class Rule:
    """One fault. ``ops``: operation names it applies to (None = every request);
    ``methods``: HTTP methods (None = any); ``fraction``: probability per
    matching request; ``count``: how many times at most (None = unlimited)."""

    action: str  #: error | reset | reset-response | cut-response | stall | hold-request | hold-response
    ops: frozenset[str] | None = None
    methods: frozenset[str] | None = None
    fraction: float = 1.0
    count: int | None = None
    status: int = 503
    code: str = "SlowDown"
    message: str = "injected by faultproxy"
    delay: float = 0.0
    after_bytes: int | None = None  #: reset: RST after this many body bytes (None: half the body); cut: the same
    rst: bool = False  #: cut: reset the connection instead of closing it
    part_numbers: frozenset[int] | None = None
    hits: int = 0
    hold: Hold | None = None

    def matches(self, rec: RequestRecord, rng: random.Random) -> bool:
        if self.count is not None and self.hits >= self.count:
            return False
        if self.ops is not None and rec.op not in self.ops:
            return False
        if self.methods is not None and rec.method not in self.methods:
            return False
        if self.part_numbers is not None and rec.part_number not in self.part_numbers:
            return False
        if self.fraction < 1.0 and rng.random() >= self.fraction:
            return False
        return True


class Hold:
    """A gate for held requests: ``wait_held()`` until one arrives, ``release()``."""

    def __init__(self):
        self._cond = threading.Condition()
        self._released = False
        self.held: list[RequestRecord] = []
        self.rule: Rule | None = None

    def _arrive(self, rec: RequestRecord) -> None:
        with self._cond:
            self.held.append(rec)
            self._cond.notify_all()

    def wait_held(self, timeout: float = 30.0, n: int = 1) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.held) >= n, timeout)

    def release(self) -> None:
        with self._cond:
            self._released = True
            self._cond.notify_all()

    @property
    def released(self) -> bool:
        return self._released


def _ops(ops: str | Iterable[str] | None) -> frozenset[str] | None:
    if ops is None:
        return None
    if isinstance(ops, str):
        return frozenset([ops])
    return frozenset(ops)


class _Bandwidth:
    """Shared token bucket (one per direction), used from the proxy's event loop."""

    def __init__(self):
        self.rate: float | None = None
        self._next = 0.0

    async def take(self, n: int) -> None:
        rate = self.rate
        if not rate:
            return
        now = time.monotonic()
        start = max(now, self._next)
        self._next = start + n / rate
        wait = self._next - now
        if wait > 0.0005:
            await asyncio.sleep(wait)


class _ClientGone(Exception):
    pass


# --------------------------------------------------------------------------
# the proxy


class FaultProxy:
    def __init__(self, upstream: str, *, host: str = "127.0.0.1", port: int = 0, seed: int | None = None):
        u = urlsplit(upstream)
        if u.scheme != "http":
            raise ValueError("faultproxy forwards plain http only")
        self.upstream_host = u.hostname or "127.0.0.1"
        self.upstream_port = u.port or 80
        self.host = host
        self.port = port
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._records: list[RequestRecord] = []
        self._ids = itertools.count(1)
        self._up = _Bandwidth()
        self._down = _Bandwidth()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._ready = threading.Event()
        self._stopped = False
        #: SO_RCVBUF of connections accepted from now on (None: the kernel's autotuning). A
        #: small one keeps a client's kernel from taking a whole request body at once.
        self.client_rcvbuf: int | None = None
        self._startup_error: BaseException | None = None
        self.connections = 0

    # -- lifecycle ---------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._startup_error is not None:
            raise self._startup_error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._handle, self.host, self.port, limit=HEAD_LIMIT, backlog=256))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(self) -> None:
        if self._stopped or self._loop is None:
            return
        self._stopped = True
        self.release_all()

        async def shutdown():
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        fut = asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        try:
            fut.result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- configuration (thread-safe) -----------------------------------------

    def set_bandwidth(self, up: float | None = None, down: float | None = None) -> None:
        """Bytes per second for request bodies (``up``) and response bodies (``down``); None = unlimited."""
        self._up.rate = up
        self._down.rate = down

    def add_rule(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove_rule(self, rule: Rule) -> None:
        with self._lock:
            if rule in self._rules:
                self._rules.remove(rule)
        if rule.hold is not None:
            rule.hold.release()

    def clear_rules(self) -> None:
        with self._lock:
            rules, self._rules = self._rules, []
        for r in rules:
            if r.hold is not None:
                r.hold.release()

    def release_all(self) -> None:
        self.clear_rules()

    def fail(self, ops=None, *, status: int = 503, code: str = "SlowDown", fraction: float = 1.0,
             count: int | None = None, methods=None, message: str = "injected by faultproxy") -> Rule:
        """Answer matching requests with an S3 error (not forwarded)."""
        return self.add_rule(Rule("error", _ops(ops), _ops(methods), fraction, count, status, code, message))

    def reset(self, ops=None, *, fraction: float = 1.0, count: int | None = None, after_bytes: int | None = None,
              methods=None, when: str = "request") -> Rule:
        """Reset the client connection (RST). ``when="request"``: after ``after_bytes`` of the
        request body (default: half of it), the server never gets the whole request;
        ``"response"``: after the server executed the request, instead of its response
        (a lost response: the client cannot tell whether it happened)."""
        if when not in ("request", "response"):
            raise ValueError("when must be 'request' or 'response'")
        action = "reset" if when == "request" else "reset-response"
        return self.add_rule(Rule(action, _ops(ops), _ops(methods), fraction, count, after_bytes=after_bytes))

    def cut(self, ops=None, *, after_bytes: int, rst: bool = False, fraction: float = 1.0,
            count: int | None = None, methods=None) -> Rule:
        """Forward the response's head and the first ``after_bytes`` of its body, then close the
        client connection (a body shorter than its Content-Length); ``rst``: reset it instead
        (a peer that crashed mid-body)."""
        return self.add_rule(Rule("cut-response", _ops(ops), _ops(methods), fraction, count,
                                  after_bytes=after_bytes, rst=rst))

    def stall(self, ops=None, seconds: float = 1.0, *, fraction: float = 1.0, count: int | None = None,
              methods=None) -> Rule:
        """Delay matching requests by ``seconds`` before forwarding them."""
        return self.add_rule(Rule("stall", _ops(ops), _ops(methods), fraction, count, delay=seconds))

    def hold(self, ops, *, when: str = "response", count: int | None = 1, methods=None,
             part_numbers: Iterable[int] | None = None) -> Hold:
        """Hold matching requests: ``when="request"`` before forwarding (the server never
        sees it until released), ``"response"`` after the server answered (the
        server executed it; the client waits)."""
        if when not in ("request", "response"):
            raise ValueError("when must be 'request' or 'response'")
        gate = Hold()
        rule = Rule(f"hold-{when}", _ops(ops), _ops(methods), 1.0, count,
                    part_numbers=frozenset(part_numbers) if part_numbers is not None else None)
        rule.hold = gate
        gate.rule = rule
        self.add_rule(rule)
        return gate

    # -- observation ---------------------------------------------------------

    def records(self, op: str | None = None) -> list[RequestRecord]:
        with self._lock:
            recs = list(self._records)
        return [r for r in recs if op is None or r.op == op]

    def counts(self, *, status: int | None = None) -> collections.Counter:
        """Requests per operation (that arrived; with ``status``: answered with it)."""
        c = collections.Counter()
        for r in self.records():
            if status is None or r.status == status:
                c[r.op] += 1
        return c

    def in_flight(self, op: str | None = None) -> list[RequestRecord]:
        return [r for r in self.records(op) if not r.done]

    def clear_records(self) -> None:
        with self._lock:
            self._records = []

    def wait_for(self, predicate, timeout: float = 30.0, interval: float = 0.02) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(interval)
        return predicate()

    # -- the data path -------------------------------------------------------

    def _match(self, rec: RequestRecord) -> Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.matches(rec, self._rng):
                    rule.hits += 1
                    return rule
        return None

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.client_rcvbuf:
            sock = cwriter.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.client_rcvbuf)
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head = await creader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                keep, up = await self._one(head, creader, cwriter, up)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, _ClientGone, OSError):
            return
        except asyncio.CancelledError:
            return
        finally:
            for w in (cwriter, up[1] if up else None):
                if w is not None:
                    try:
                        w.close()
                    except Exception:  # noqa: BLE001
                        pass

    async def _one(self, head: bytes, creader, cwriter, up):
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            if not line:
                continue
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
        hmap = {n.lower(): v for n, v in headers}
        u = urlsplit(target)
        query = parse_qs(u.query, keep_blank_values=True)
        op = classify(method, u.path, query, hmap)
        key_parts = unquote(u.path).lstrip("/").split("/", 1)
        clen = int(hmap["content-length"]) if "content-length" in hmap else None
        chunked = "chunked" in hmap.get("transfer-encoding", "").lower()
        rec = RequestRecord(
            id=next(self._ids), op=op, method=method, path=u.path,
            key=key_parts[1] if len(key_parts) == 2 else "",
            part_number=int(query["partNumber"][0]) if "partNumber" in query else None,
            upload_id=query["uploadId"][0] if "uploadId" in query else None,
            content_length=clen, t_start=time.monotonic(),
        )
        with self._lock:
            self._records.append(rec)
        client_close = hmap.get("connection", "").lower() == "close"
        expect = hmap.get("expect", "").lower() == "100-continue"
        rule = self._match(rec)
        try:
            return await self._serve(rec, rule, method, head, headers, creader, cwriter, up,
                                     clen, chunked, expect, client_close)
        finally:
            if rec.t_end is None:
                rec.t_end = time.monotonic()
            if rec.outcome == "pending":
                rec.outcome = "client-gone"

    async def _serve(self, rec, rule, method, head, headers, creader, cwriter, up, clen, chunked, expect,
                     client_close):
        if rule is not None and rule.action == "error":
            rec.fault = f"error {rule.status} {rule.code}"
            if expect:
                # never asked for the body: answer and close (the body may or may not follow)
                await self._send_error(cwriter, rec, rule, method, close=True)
                rec.outcome = "injected"
                return False, up
            await self._drain_body(creader, rec, clen, chunked)
            await self._send_error(cwriter, rec, rule, method, close=client_close)
            rec.outcome = "injected"
            return not client_close, up
        if rule is not None and rule.action == "stall":
            rec.fault = f"stall {rule.delay}"
            await asyncio.sleep(rule.delay)
        if rule is not None and rule.action == "hold-request":
            rec.fault = "hold-request"
            rule.hold._arrive(rec)
            while not rule.hold.released and not self._stopped:
                await asyncio.sleep(0.02)

        # forward the request head (signatures cover it: unchanged, minus Expect)
        if up is None:
            up = await asyncio.open_connection(self.upstream_host, self.upstream_port, limit=HEAD_LIMIT)
        ureader, uwriter = up
        if expect:
            head = self._strip_header(head, "expect")
            cwriter.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            uwriter.write(head)
            rec.forwarded = True
            reset_at = None
            if rule is not None and rule.action == "reset":
                rec.fault = "reset"
                reset_at = rule.after_bytes if rule.after_bytes is not None else (clen or 0) // 2
            await self._copy_body(creader, uwriter, rec, clen, chunked, reset_at, cwriter)
            await uwriter.drain()
        except _ClientGone:
            self._abort(uwriter)
            raise
        except (ConnectionError, OSError):
            self._abort(uwriter)
            raise _ClientGone() from None

        # the response
        try:
            status, rhead, rclen, rchunked, upstream_close = await self._read_response_head(ureader)
            while 100 <= status < 200:
                status, rhead, rclen, rchunked, upstream_close = await self._read_response_head(ureader)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            rec.outcome = "upstream-error"
            cwriter.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            rec.status = 502
            return False, None
        no_body = method == "HEAD" or status in (204, 304)
        if rule is not None and rule.action == "reset-response":
            rec.fault = "reset-response"
            if not no_body:
                async for _chunk in self._iter_body(ureader, rclen, rchunked, upstream_close, raw=True):
                    pass
            rec.outcome = "reset"
            rec.t_end = time.monotonic()
            self._reset(cwriter)
            if upstream_close:
                self._abort(uwriter)
                up = None
            raise _ClientGone()
        hold = rule is not None and rule.action == "hold-response"
        if hold:
            rec.fault = "hold-response"
            body = bytearray()
            if not no_body:
                async for chunk in self._iter_body(ureader, rclen, rchunked, upstream_close, raw=True):
                    body += chunk
            rule.hold._arrive(rec)
            while not rule.hold.released and not self._stopped:
                await asyncio.sleep(0.02)
            cwriter.write(rhead + bytes(body))
            rec.bytes_out = len(body)
            await cwriter.drain()
        else:
            cut_at = rule.after_bytes if rule is not None and rule.action == "cut-response" else None
            cwriter.write(rhead)
            if not no_body:
                async for chunk in self._iter_body(ureader, rclen, rchunked, upstream_close, raw=True):
                    await self._down.take(len(chunk))
                    if cut_at is not None and rec.bytes_out + len(chunk) >= cut_at:
                        await self._cut(cwriter, uwriter, rec, rule, chunk[:cut_at - rec.bytes_out])
                    cwriter.write(chunk)
                    rec.bytes_out += len(chunk)
                    if cwriter.transport.get_write_buffer_size() > 4 * CHUNK:
                        await cwriter.drain()
            await cwriter.drain()
        rec.status = status
        rec.outcome = "ok"
        rec.t_end = time.monotonic()
        if upstream_close:
            self._abort(uwriter)
            up = None
        return not (client_close or upstream_close), up

    async def _cut(self, cwriter, uwriter, rec, rule, last: bytes) -> None:
        """Send ``last`` (the end of a cut body), then close or reset the client connection."""
        rec.fault = "cut-response"
        cwriter.write(last)
        rec.bytes_out += len(last)
        await cwriter.drain()
        rec.outcome = "cut"
        rec.t_end = time.monotonic()
        self._abort(uwriter)  # the rest of the upstream body is not read
        if rule.rst:
            self._reset(cwriter)
        raise _ClientGone()  # the caller closes the client connection (FIN) if still open

    @classmethod
    def _reset(cls, writer) -> None:
        """Close the connection with a RST (SO_LINGER 0), not a FIN."""
        sock = writer.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        cls._abort(writer)

    @staticmethod
    def _strip_header(head: bytes, name: str) -> bytes:
        lines = head.split(b"\r\n")
        keep = [ln for ln in lines if not ln.lower().startswith(name.encode() + b":")]
        return b"\r\n".join(keep)

    @staticmethod
    def _abort(writer) -> None:
        try:
            writer.transport.abort()
        except Exception:  # noqa: BLE001
            pass

    async def _send_error(self, cwriter, rec, rule, method, *, close: bool) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{rule.code}</Code>'
                f"<Message>{rule.message}</Message><RequestId>faultproxy-{rec.id}</RequestId></Error>").encode()
        reason = {403: "Forbidden", 404: "Not Found", 500: "Internal Server Error",
                  503: "Slow Down"}.get(rule.status, "Error")
        hdrs = [f"HTTP/1.1 {rule.status} {reason}", "Content-Type: application/xml",
                f"Content-Length: {len(body)}", f"x-amz-request-id: faultproxy-{rec.id}"]
        if close:
            hdrs.append("Connection: close")
        cwriter.write(("\r\n".join(hdrs) + "\r\n\r\n").encode() + (b"" if method == "HEAD" else body))
        await cwriter.drain()
        rec.status = rule.status
        rec.t_end = time.monotonic()

    async def _drain_body(self, creader, rec, clen, chunked) -> None:
        async for chunk in self._iter_body(creader, clen, chunked, False, raw=True):
            rec.bytes_in += len(chunk)

    async def _copy_body(self, creader, uwriter, rec, clen, chunked, reset_at, cwriter) -> None:
        try:
            async for chunk in self._iter_body(creader, clen, chunked, False, raw=True,
                                               cap=reset_at, got=lambda: rec.bytes_in):
                await self._up.take(len(chunk))
                uwriter.write(chunk)
                rec.bytes_in += len(chunk)
                if uwriter.transport.get_write_buffer_size() > 4 * CHUNK:
                    await uwriter.drain()
                if reset_at is not None and rec.bytes_in >= reset_at:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            raise _ClientGone() from None
        if reset_at is not None:
            # RST the client, abandon the half-sent request upstream
            rec.outcome = "reset"
            rec.t_end = time.monotonic()
            self._reset(cwriter)
            raise _ClientGone()

    async def _read_response_head(self, ureader):
        rhead = await ureader.readuntil(b"\r\n\r\n")
        lines = rhead.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        h = {}
        for line in lines[1:]:
            if line:
                n, _, v = line.partition(":")
                h[n.strip().lower()] = v.strip()
        rclen = int(h["content-length"]) if "content-length" in h else None
        rchunked = "chunked" in h.get("transfer-encoding", "").lower()
        close = h.get("connection", "").lower() == "close"
        if rclen is None and not rchunked and not (100 <= status < 200) and status not in (204, 304):
            close = True  # body until EOF
        return status, rhead, rclen, rchunked, close

    async def _iter_body(self, reader, clen, chunked, until_eof, *, raw: bool, cap=None, got=None):
        """Yield the raw bytes of a message body (chunked framing passed through)."""
        if chunked:
            while True:
                line = await reader.readuntil(b"\r\n")
                size = int(line.split(b";", 1)[0].strip(), 16)
                yield line
                if size == 0:
                    # trailers until an empty line
                    while True:
                        t = await reader.readuntil(b"\r\n")
                        yield t
                        if t == b"\r\n":
                            return
                left = size + 2
                while left:
                    data = await reader.read(min(CHUNK, left))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
        elif clen is not None:
            left = clen
            while left:
                want = min(CHUNK, left)
                if cap is not None and got is not None and cap > got():
                    want = min(want, cap - got())
                data = await reader.read(want)
                if not data:
                    raise asyncio.IncompleteReadError(b"", left)
                left -= len(data)
                yield data
        elif until_eof:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    return
                yield data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m integration.faultproxy")
    ap.add_argument("--upstream", required=True, help="http://host:port of the S3 endpoint")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--up-mibps", type=float, default=None, help="upload bandwidth limit, MiB/s")
    ap.add_argument("--down-mibps", type=float, default=None)
    ap.add_argument("--error-rate", type=float, default=0.0, help="fraction of data requests answered 503 SlowDown")
    ap.add_argument("--reset-rate", type=float, default=0.0, help="fraction of UploadParts reset mid-body")
    args = ap.parse_args(argv)
    proxy = FaultProxy(args.upstream, port=args.port).start()
    proxy.set_bandwidth(up=args.up_mibps * MiB if args.up_mibps else None,
                        down=args.down_mibps * MiB if args.down_mibps else None)
    if args.error_rate:
        proxy.fail(["UploadPart", "PutObject", "CompleteMultipartUpload"], fraction=args.error_rate)
    if args.reset_rate:
        proxy.reset("UploadPart", fraction=args.reset_rate)
    print(f"faultproxy on {proxy.url} -> {args.upstream}; Ctrl-C to stop", flush=True)
    try:
        while True:
            time.sleep(5)
            print(dict(proxy.counts()), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
