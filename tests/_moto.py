"""Helpers to run a moto S3 server as a subprocess for drain store tests
(no conftest: test modules import this and define their own fixtures)."""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request

import trio

FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing-akid",
    "AWS_SECRET_ACCESS_KEY": "testing-secret",
    "AWS_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/ckptfs-test-aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/ckptfs-test-aws-credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    def __init__(self, *, enforce_auth: bool = False):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.update(FAKE_ENV)
        if enforce_auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).read()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("moto server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def boto3_client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=FAKE_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=FAKE_ENV["AWS_SECRET_ACCESS_KEY"],
        )

    def make_bucket(self, name: str) -> None:
        self.boto3_client().create_bucket(Bucket=name)


_shared: dict[str, MotoServer] = {}


def shared_server(name: str = "main", *, enforce_auth: bool = False) -> MotoServer:
    """One moto server per pytest process (started on first use, stopped at
    exit), shared by the test modules: saves a server start per module."""
    srv = _shared.get(name)
    if srv is None or srv.proc.poll() is not None:
        srv = MotoServer(enforce_auth=enforce_auth)
        _shared[name] = srv
        atexit.register(srv.stop)
        srv.wait_ready()
    return srv


@contextlib.contextmanager
def fake_aws_env():
    old = {k: os.environ.get(k) for k in FAKE_ENV}
    os.environ.update(FAKE_ENV)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(async_fn, *args):
    """Run an async test body under trio."""
    return trio.run(async_fn, *args)
