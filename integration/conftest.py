"""pytest fixtures for the ckptfs integration suite.

* ``s3_server`` (session): the server chosen by ``CKPTFS_S3`` /
  ``CKPTFS_S3_ENDPOINT`` (default: a throwaway radosgw, also serving https
  with a self-signed certificate), stopped at the end of the session.
* ``s3_bucket`` (function): a fresh, uniquely named bucket on ``s3_server``;
  emptied and deleted afterwards (best effort).
* ``moto_server`` (session): a ``python -m moto.server`` instance.

Tests marked ``@pytest.mark.radosgw`` are skipped unless ``s3_server.kind``
is "radosgw".  Set ``CKPTFS_S3_KEEP=1`` to keep the cluster's whole work
directory (by default only its logs are kept, under pytest's tmp dir).
"""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

from integration.s3server import S3Server, start_from_env, start_moto


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "radosgw: needs the real Ceph radosgw (skipped on moto/external)")


def _keep() -> bool:
    return os.environ.get("CKPTFS_S3_KEEP", "") not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> S3Server:
    wd = tmp_path_factory.mktemp("s3server") / "cluster"
    server = start_from_env(wd, tls=True)
    try:
        yield server
    finally:
        server.stop(remove=False)
        if server.workdir is not None and not _keep():
            # drop the data (the OSD block file can be GiBs), keep the logs
            for name in ("osd-block.img", "osd", "mon", "mgr", "rgw", "crash"):
                p = server.workdir / name
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def moto_server() -> S3Server:
    server = start_moto()
    try:
        yield server
    finally:
        server.stop()


def _empty_and_delete(client, bucket: str) -> None:
    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for u in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=bucket, Key=u["Key"],
                                              UploadId=u["UploadId"])
        for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket):
            objs = [{"Key": v["Key"], "VersionId": v["VersionId"]}
                    for v in page.get("Versions", []) + page.get("DeleteMarkers", [])]
            if objs:
                client.delete_objects(Bucket=bucket, Delete={"Objects": objs, "Quiet": True})
        client.delete_bucket(Bucket=bucket)
    except Exception:  # noqa: BLE001 - cleanup is best effort
        pass


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    name = f"ckptfs-test-{uuid.uuid4().hex[:16]}"
    s3_server.make_bucket(name)
    yield name
    _empty_and_delete(s3_server.client(), name)


@pytest.fixture(autouse=True)
def _skip_unless_radosgw(request):
    if request.node.get_closest_marker("radosgw") is not None:
        server = request.getfixturevalue("s3_server")
        if server.kind != "radosgw":
            pytest.skip(f"needs radosgw, S3 server is {server.kind}")
