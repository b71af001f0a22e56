"""Local stand-ins for the AWS credential endpoints, handing out real radosgw keys.

* :class:`RadosgwKeys`: S3 keys of the harness's radosgw user, made and deleted with
  ``radosgw-admin`` (so a request signed with a deleted key is refused: InvalidAccessKeyId);
  with ``rotate_every``, a thread makes a new key every so many seconds and deletes the
  previous one ``grace`` seconds later.
* :class:`FakeCredentialEndpoints`: one HTTP server on 127.0.0.1 answering as

  - the container credentials endpoint (``AWS_CONTAINER_CREDENTIALS_FULL_URI``, EKS Pod
    Identity / ECS) at ``/v1/credentials``, checking the ``Authorization`` header against
    the token when one is set;
  - IMDSv2 (``AWS_EC2_METADATA_SERVICE_ENDPOINT``): ``PUT /latest/api/token``, then the role
    name and the role's credentials under ``/latest/meta-data/iam/security-credentials/``,
    only with the session token (IMDSv1 requests are refused with 401);
  - STS (``AWS_ENDPOINT_URL_STS``): ``AssumeRoleWithWebIdentity``, checking the role ARN and
    the web identity token.

  Each answer carries the key current at that moment, its ``Expiration`` and a dummy
  session token (:data:`SESSION_TOKEN`).

Never used outside tests; the secrets are throwaway keys of a throwaway cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import secrets
import subprocess
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from xml.sax.saxutils import escape

from integration.s3server import RGW_USER, S3Server

ROLE_NAME = "ckptfs-test-role"
ROLE_ARN = f"arn:aws:iam::123456789012:role/{ROLE_NAME}"
#: what the fakes hand out as the session token: radosgw's own keys have none, and it
#: ignores an ``x-amz-security-token`` sent with one of them
SESSION_TOKEN = "ckptfs-test-session-token"


@dataclasses.dataclass(frozen=True)
class Key:
    access_key: str
    secret_key: str
    issued: float  #: time.time() when made
    expires: float | None  #: time.time() of the Expiration handed out with it

    def expiration(self) -> str:
        assert self.expires is not None
        return dt.datetime.fromtimestamp(self.expires, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class RadosgwKeys:
    """Keys of the radosgw user that owns the test buckets. Without ``rotate_every`` one key,
    valid until :meth:`close` (its ``Expiration`` ``lifetime`` ahead of each answer: the
    endpoints always give one).
    With it, a rotation every ``rotate_every`` seconds, the previous key deleted ``grace``
    seconds after it; each key's advertised ``Expiration`` is its deletion time."""

    def __init__(self, s3: S3Server, *, rotate_every: float | None = None, grace: float = 10.0,
                 lifetime: float = 3600.0):
        if s3.workdir is None:
            raise RuntimeError("needs the harness's own radosgw (radosgw-admin)")
        self._env = dict(os.environ, CEPH_CONF=str(s3.workdir / "ceph.conf"))
        self._s3 = s3
        self.rotate_every = rotate_every
        self.grace = grace
        self.lifetime = lifetime
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.issued: list[Key] = []
        self.deleted: list[tuple[str, float]] = []  #: (access key, time deleted)
        self.errors: list[str] = []
        self._current = self._make()

    def _admin(self, *args: str) -> None:
        subprocess.run(["radosgw-admin", *args], env=self._env, check=True, capture_output=True, timeout=60)

    def _make(self) -> Key:
        ak = "CKPT" + secrets.token_hex(8).upper()
        sk = secrets.token_urlsafe(30)
        self._admin("key", "create", f"--uid={RGW_USER}", "--key-type=s3", f"--access-key={ak}",
                    f"--secret-key={sk}")
        now = time.time()
        expires = now + self.rotate_every + self.grace if self.rotate_every else None
        key = Key(ak, sk, now, expires)
        self.issued.append(key)
        return key

    def delete(self, key: Key) -> None:
        self._admin("key", "rm", f"--uid={RGW_USER}", "--key-type=s3", f"--access-key={key.access_key}")
        self.deleted.append((key.access_key, time.time()))

    def current(self) -> Key:
        with self._lock:
            key = self._current
        if key.expires is None:
            return dataclasses.replace(key, expires=time.time() + self.lifetime)
        return key

    def start(self) -> RadosgwKeys:
        if self.rotate_every:
            self._thread = threading.Thread(target=self._rotate, name="key-rotation", daemon=True)
            self._thread.start()
        return self

    def _rotate(self) -> None:
        pending: list[tuple[float, Key]] = []  # (delete at, key)
        next_rotation = self._current.issued + self.rotate_every
        while not self._stop.is_set():
            now = time.time()
            try:
                if now >= next_rotation:
                    new = self._make()
                    with self._lock:
                        old, self._current = self._current, new
                    pending.append((old.expires, old))
                    next_rotation = new.issued + self.rotate_every
                while pending and pending[0][0] <= time.time():
                    self.delete(pending.pop(0)[1])
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(e))
            wake = min([next_rotation] + [t for t, _ in pending])
            self._stop.wait(max(0.0, min(0.5, wake - time.time())))

    def refused(self, key: Key) -> bool:
        """Whether radosgw now refuses ``key`` (a ListBuckets signed with it)."""
        import boto3
        import botocore.exceptions

        c = boto3.client("s3", endpoint_url=self._s3.endpoint_url, region_name=self._s3.region,
                         aws_access_key_id=key.access_key, aws_secret_access_key=key.secret_key,
                         config=self._s3.boto_config(retries={"max_attempts": 1}))
        try:
            c.list_buckets()
        except botocore.exceptions.ClientError as e:
            return e.response["Error"]["Code"] in ("InvalidAccessKeyId", "AccessDenied")
        return False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for key in self.issued:
            if key.access_key not in {ak for ak, _ in self.deleted}:
                with contextlib.suppress(Exception):
                    self.delete(key)


class FakeCredentialEndpoints:
    """The container endpoint, IMDSv2 and STS on one 127.0.0.1 port (see the module doc)."""

    def __init__(self, keys: RadosgwKeys, *, container_token: str | None = None,
                 web_identity_token: str | None = None):
        self.keys = keys
        self.container_token = container_token
        self.web_identity_token = web_identity_token
        self.imds_tokens: set[str] = set()
        self.hits: dict[str, int] = {}  #: answers with credentials, by endpoint
        self.refusals: list[str] = []  #: requests refused (wrong token, IMDSv1, ...)
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                outer._put(self)

            def do_GET(self):
                outer._get(self)

            def do_POST(self):
                outer._post(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-creds", daemon=True)

    def start(self) -> FakeCredentialEndpoints:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> FakeCredentialEndpoints:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _count(self, what: str) -> None:
        with self._lock:
            self.hits[what] = self.hits.get(what, 0) + 1

    def _refuse(self, h, status: int, why: str) -> None:
        with self._lock:
            self.refusals.append(why)
        h._send(status, json.dumps({"message": why}).encode())

    def _creds(self) -> dict:
        key = self.keys.current()
        return {"AccessKeyId": key.access_key, "SecretAccessKey": key.secret_key, "Token": SESSION_TOKEN,
                "Expiration": key.expiration()}

    # -- IMDSv2 ------------------------------------------------------------------------

    def _put(self, h) -> None:
        if h.path != "/latest/api/token" or not h.headers.get("x-aws-ec2-metadata-token-ttl-seconds"):
            return self._refuse(h, 400, f"PUT {h.path}")
        token = secrets.token_hex(16)
        with self._lock:
            self.imds_tokens.add(token)
        h._send(200, token.encode(), "text/plain")

    def _get(self, h) -> None:
        base = "/latest/meta-data/iam/security-credentials/"
        if h.path.startswith(base):
            if h.headers.get("x-aws-ec2-metadata-token") not in self.imds_tokens:
                return self._refuse(h, 401, "IMDS request without a session token (IMDSv1)")
            if h.path == base:
                return h._send(200, ROLE_NAME.encode(), "text/plain")
            if h.path != base + ROLE_NAME:
                return self._refuse(h, 404, f"GET {h.path}")
            self._count("imds")
            body = {"Code": "Success", "LastUpdated": dt.datetime.now(dt.timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%SZ"), "Type": "AWS-HMAC", **self._creds()}
            return h._send(200, json.dumps(body).encode())
        if h.path == "/v1/credentials":
            if self.container_token is not None and h.headers.get("Authorization") != self.container_token:
                return self._refuse(h, 401, "container endpoint: wrong or missing Authorization")
            self._count("container")
            return h._send(200, json.dumps(self._creds()).encode())
        self._refuse(h, 404, f"GET {h.path}")

    # -- STS ---------------------------------------------------------------------------

    def _post(self, h) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        form = urllib.parse.parse_qs(h.rfile.read(n).decode())
        arg = lambda name: (form.get(name) or [""])[0]  # noqa: E731
        if arg("Action") != "AssumeRoleWithWebIdentity":
            return self._refuse(h, 400, f"STS action {arg('Action')!r}")
        if arg("RoleArn") != ROLE_ARN or arg("WebIdentityToken") != self.web_identity_token:
            body = ("<ErrorResponse><Error><Type>Sender</Type><Code>AccessDenied</Code>"
                    "<Message>not this role or token</Message></Error></ErrorResponse>")
            with self._lock:
                self.refusals.append("sts: wrong role or token")
            return h._send(403, body.encode(), "text/xml")
        self._count("sts")
        c = self._creds()
        expiration = c["Expiration"]
        body = (
            '<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            "<AssumeRoleWithWebIdentityResult>"
            f"<Credentials><AccessKeyId>{escape(c['AccessKeyId'])}</AccessKeyId>"
            f"<SecretAccessKey>{escape(c['SecretAccessKey'])}</SecretAccessKey>"
            f"<SessionToken>{SESSION_TOKEN}</SessionToken><Expiration>{expiration}</Expiration></Credentials>"
            f"<AssumedRoleUser><Arn>{ROLE_ARN}/session</Arn><AssumedRoleId>AROA:session</AssumedRoleId>"
            "</AssumedRoleUser><SubjectFromWebIdentityToken>system:serviceaccount:ns:sa"
            "</SubjectFromWebIdentityToken></AssumeRoleWithWebIdentityResult>"
            "<ResponseMetadata><RequestId>fake</RequestId></ResponseMetadata>"
            "</AssumeRoleWithWebIdentityResponse>")
        h._send(200, body.encode(), "text/xml")
