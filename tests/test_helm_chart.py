"""The Helm chart in helm/ckptfs, rendered with a real Helm v4 and checked as a user relies on it.

Helm comes from `scripts/setup.sh --test` (.venv/bin/helm). Rendered core objects are validated
against the Kubernetes OpenAPI schemas shipped by kubernetes-validate; the Prometheus Operator
CRD objects (ServiceMonitor, PrometheusRule) are checked by hand. Nothing here imports ckptfs:
the chart is tested as a package of text, the way Helm and the cluster see it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ckptfs.fsmeta.settings import build_settings
from ckptfs.lifecycle.rules import rules_from_table

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "ckptfs"
HELM = Path(sys.prefix) / "bin" / "helm"
if not HELM.exists():
    HELM = REPO / ".venv" / "bin" / "helm"

# Newest Kubernetes release whose schemas kubernetes-validate ships (1.37.0 in kubernetes-validate 1.37).
K8S_VERSION = "1.37.0"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
BUCKET = "s3://ckpt-bucket/runs"

# The metrics contract of the gateway and drain; the dashboard and alerts may use only these.
METRIC_CONTRACT = {
    "ckptfs_build_info": "gauge",
    "ckptfs_data_path": "gauge",
    "ckptfs_fuse_transport": "gauge",
    "ckptfs_dirty_files": "gauge",
    "ckptfs_dirty_bytes": "gauge",
    "ckptfs_oldest_dirty_age_seconds": "gauge",
    "ckptfs_uploaded_bytes_total": "counter",
    "ckptfs_uploaded_files_total": "counter",
    "ckptfs_upload_request_duration_seconds": "histogram",
    "ckptfs_time_to_durable_seconds": "histogram",
    "ckptfs_upload_retries_total": "counter",
    "ckptfs_upload_errors_total": "counter",
    "ckptfs_files_in_error": "gauge",
    "ckptfs_multipart_uploads_open": "gauge",
    "ckptfs_cache_bytes": "gauge",
    "ckptfs_cache_max_bytes": "gauge",
    "ckptfs_cache_evictions_total": "counter",
    "ckptfs_backpressure_wait_seconds_total": "counter",
    "ckptfs_backpressure_waiting_writers": "gauge",
    "ckptfs_fuse_requests_total": "counter",
    "ckptfs_fuse_errors_total": "counter",
    "ckptfs_fuse_request_duration_seconds": "histogram",
    "ckptfs_drain_restarts_total": "counter",
    "ckptfs_drain_crash_looping": "gauge",
    "ckptfs_markers_held": "gauge",
    "ckptfs_nodes_lost": "gauge",
    "ckptfs_marker_held_longest_seconds": "gauge",
    "ckptfs_inflight_publish_failures_total": "counter",
    "ckptfs_inflight_records_published_total": "counter",
}

# The settings ckptfs accepts in its TOML file (it refuses any other key); the chart renders a subset.
CKPTFS_TOML_KEYS = {
    "": {"bucket_url", "endpoint_url", "region"},
    "mount": {"fsync", "metrics_addr", "allow_other", "endpoint_url", "region", "fuse_io_uring"},
    "cache": {"dir", "max_size", "high_watermark", "low_watermark", "backpressure_timeout"},
    "drain": {"settle_seconds", "part_size", "concurrency", "markers", "checksum", "sign_payload"},
}
LIFECYCLE_KEYS = {
    "checkpoints", "markers", "keep_latest", "keep_every_steps", "keep_geometric", "expire_after_days",
    "incomplete_grace_hours", "tiers", "prices", "min_transition_bytes",
}

LIFECYCLE_RULES = {
    "checkpoints": ["step_{step}", "checkpoint-{step}"],
    "markers": [".metadata", "commit_success.txt"],
    "keep_latest": 3,
    "keep_every_steps": 1000,
    "incomplete_grace_hours": 6.5,
    "tiers": [{"after_days": 7, "storage_class": "STANDARD_IA"},
              {"after_days": 30, "storage_class": "GLACIER_IR"}],
    "prices": {"STANDARD": 0.023, "GLACIER_IR": 0.004},
}

EVERYTHING = {
    "s3": {"bucketUrl": BUCKET, "endpointUrl": "http://rgw.storage.svc:7480", "region": "us-east-1",
           "existingSecret": "ckpt-s3-creds"},
    "lifecycle": {"rules": LIFECYCLE_RULES, "cronJob": {"enabled": True}},
    "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
                "dashboard": {"enabled": True}},
    "probes": {"liveness": {"enabled": True}},
    "mount": {"path": "/mnt/ckpt", "enableKernelIoUring": True},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "resources": {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "8Gi"}},
}


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        out = subprocess.run([str(HELM), "version", "--short"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.fail(f"helm not found at {HELM}: run scripts/setup.sh --test (it installs .venv/bin/helm)")
    assert out.returncode == 0, f"{HELM} version failed: {out.stderr}; run scripts/setup.sh --test"
    assert out.stdout.startswith("v4."), f"expected Helm v4, got {out.stdout!r}"
    return HELM


def _merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def helm_template(helm: Path, tmp_path: Path, values: dict) -> subprocess.CompletedProcess:
    values_file = tmp_path / f"values-{len(list(tmp_path.iterdir()))}.yaml"
    values_file.write_text(yaml.safe_dump(values))
    return subprocess.run(
        [str(helm), "template", "ckpt", str(CHART), "--namespace", "ml-infra", "-f", str(values_file)],
        capture_output=True, text=True, timeout=60,
    )


def render(helm: Path, tmp_path: Path, values: dict | None = None) -> list[dict]:
    values = _merge({"s3": {"bucketUrl": BUCKET}}, values or {})
    out = helm_template(helm, tmp_path, values)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def refused(helm: Path, tmp_path: Path, values: dict) -> str:
    out = helm_template(helm, tmp_path, values)
    assert out.returncode != 0, f"helm template accepted {values}:\n{out.stdout[:2000]}"
    return out.stderr


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[d['kind'] for d in docs]}"
    return found[0]


def gateway(docs: list[dict]) -> dict:
    return one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]


def docs_toml_text(docs: list[dict]) -> str:
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "ckptfs.toml" in d["data"])
    return cm["data"]["ckptfs.toml"]


def ckptfs_toml(docs: list[dict]) -> dict:
    return tomllib.loads(docs_toml_text(docs))


# ---------------------------------------------------------------- lint and Kubernetes schemas


def test_helm_lint_strict(helm, tmp_path):
    values = tmp_path / "lint.yaml"
    values.write_text(yaml.safe_dump(EVERYTHING))
    out = subprocess.run([str(helm), "lint", "--strict", str(CHART), "-f", str(values)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("values", [{}, EVERYTHING], ids=["defaults", "everything-enabled"])
def test_core_objects_are_valid_kubernetes(helm, tmp_path, values):
    docs = render(helm, tmp_path, values)
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "ConfigMap", "Service", "ServiceAccount"} <= kinds
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        # strict: an unknown or misplaced field is an error, as `kubectl apply` would report
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_crd_objects_render_only_when_enabled_and_are_well_formed(helm, tmp_path):
    assert not {d["kind"] for d in render(helm, tmp_path)} & CRD_KINDS
    docs = render(helm, tmp_path, EVERYTHING)

    sm = one(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    svc = one(docs, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"]["matchNames"] == ["ml-infra"]
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    assert svc["spec"]["ports"][0]["name"] == "metrics" and svc["spec"]["ports"][0]["port"] == 9810
    # the Service selects the gateway pods
    pod_labels = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()

    rule = one(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    groups = rule["spec"]["groups"]
    assert groups and all(g["name"] and g["rules"] for g in groups)
    alerts = {r["alert"]: r for g in groups for r in g["rules"]}
    assert set(alerts) == {"CkptfsOldestDirtyTooOld", "CkptfsPermanentUploadErrors", "CkptfsBackpressure",
                           "CkptfsCacheNearCap", "CkptfsDrainCrashLooping", "CkptfsMarkerHeldByOtherNodes"}
    for r in alerts.values():
        assert isinstance(r["expr"], str) and r["expr"].strip()
        assert r["labels"]["severity"] in {"warning", "critical"}
        assert r["annotations"]["summary"]


def test_alert_thresholds_come_from_values(helm, tmp_path):
    docs = render(helm, tmp_path, {"metrics": {"prometheusRule": {
        "enabled": True, "oldestDirtyAgeSeconds": 4321, "cacheUsageRatio": 0.85, "markerHeldSeconds": 777}}})
    alerts = {r["alert"]: r["expr"] for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    assert re.search(r"ckptfs_oldest_dirty_age_seconds.*>\s*4321\b", alerts["CkptfsOldestDirtyTooOld"])
    assert re.search(r"ckptfs_cache_max_bytes.*>\s*0\.85\b", alerts["CkptfsCacheNearCap"], re.S)
    assert re.search(r"ckptfs_files_in_error.*>\s*0\b", alerts["CkptfsPermanentUploadErrors"])
    assert re.search(r"ckptfs_backpressure_waiting_writers.*>\s*0\b", alerts["CkptfsBackpressure"])
    assert re.search(r"ckptfs_drain_crash_looping.*>\s*0\b", alerts["CkptfsDrainCrashLooping"])
    assert re.search(r"ckptfs_marker_held_longest_seconds.*>\s*777\b", alerts["CkptfsMarkerHeldByOtherNodes"])


# ---------------------------------------------------------------- the gateway DaemonSet


def test_gateway_is_privileged_with_dev_fuse_cache_and_propagated_mount(helm, tmp_path):
    docs = render(helm, tmp_path, {"mount": {"path": "/mnt/ckpt"}, "cache": {"hostPath": "/nvme0/ckptfs"}})
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    c = gateway(docs)
    assert c["securityContext"]["privileged"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}

    fuse = volumes[mounts["/dev/fuse"]["name"]]["hostPath"]
    assert fuse == {"path": "/dev/fuse", "type": "CharDevice"}

    cache = volumes[mounts["/nvme0/ckptfs"]["name"]]["hostPath"]
    assert cache == {"path": "/nvme0/ckptfs", "type": "DirectoryOrCreate"}

    # The FUSE mount at /mnt/ckpt must reach the host: it is made inside a Bidirectional hostPath
    # volume (the mount point's parent, so a dead mount after a crash cannot block the next pod).
    propagated = [m for m in c["volumeMounts"] if m.get("mountPropagation") == "Bidirectional"]
    assert len(propagated) == 1
    m = propagated[0]
    assert "/mnt/ckpt".startswith(m["mountPath"].rstrip("/") + "/")
    assert volumes[m["name"]]["hostPath"]["path"] == m["mountPath"]
    # the init container creates the mount point on the host through that volume
    init = pod["initContainers"][0]
    assert "/mnt/ckpt" in init["command"] and init["volumeMounts"][0]["name"] == m["name"]
    assert "privileged" not in init.get("securityContext", {})
    assert [i["name"] for i in pod["initContainers"]] == ["mountpoint"]


def test_fuse_io_uring_setting_and_kernel_parameter(helm, tmp_path):
    assert ckptfs_toml(render(helm, tmp_path))["mount"]["fuse_io_uring"] == "auto"
    docs = render(helm, tmp_path, {"mount": {"path": "/mnt/ckpt", "fuseIoUring": "on", "enableKernelIoUring": True}})
    assert ckptfs_toml(docs)["mount"]["fuse_io_uring"] == "on"
    inits = {i["name"]: i for i in one(docs, "DaemonSet")["spec"]["template"]["spec"]["initContainers"]}
    kernel = inits["fuse-io-uring"]
    assert kernel["securityContext"]["privileged"] is True  # /sys is read-only otherwise
    assert "echo Y > /sys/module/fuse/parameters/enable_uring" in kernel["command"][-1]


def test_gateway_command_and_placement(helm, tmp_path):
    docs = render(helm, tmp_path, {
        "metrics": {"port": 9911}, "cache": {"hostPath": "/nvme0/ckptfs"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "updateStrategy": {"maxUnavailable": 2},
    })
    ds = one(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = gateway(docs)
    assert c["command"] == [
        "ckptfs", "mount", BUCKET, "/mnt/ckpt", "--foreground", "--config", "/etc/ckptfs/ckptfs.toml",
        "--cache-dir", "/nvme0/ckptfs", "--metrics-addr", "0.0.0.0:9911",
    ]
    assert {"containerPort": 9911, "name": "metrics", "protocol": "TCP"} in c["ports"]
    config_mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/ckptfs")
    assert config_mount["readOnly"] is True
    assert c["readinessProbe"]["exec"]["command"] == ["mountpoint", "-q", "/mnt/ckpt"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 2}}
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "2Gi"}

    with_endpoint = gateway(render(helm, tmp_path, {"s3": {"endpointUrl": "http://rgw:7480"}}))["command"]
    assert with_endpoint[-2:] == ["--endpoint-url", "http://rgw:7480"]


def test_prestop_drains_within_a_longer_grace_period(helm, tmp_path):
    docs = render(helm, tmp_path, {"shutdown": {"drainTimeoutSeconds": 900, "terminationGracePeriodSeconds": 1000}})
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert gateway(docs)["lifecycle"]["preStop"]["exec"]["command"] == [
        "ckptfs", "umount", "/mnt/ckpt", "--wait-durable", "--timeout", "900"]
    assert pod["terminationGracePeriodSeconds"] == 1000

    defaults = render(helm, tmp_path)
    cmd = gateway(defaults)["lifecycle"]["preStop"]["exec"]["command"]
    timeout = int(cmd[cmd.index("--timeout") + 1])
    assert one(defaults, "DaemonSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > timeout + 30

    err = refused(helm, tmp_path, {"s3": {"bucketUrl": BUCKET},
                                   "shutdown": {"drainTimeoutSeconds": 900, "terminationGracePeriodSeconds": 920}})
    assert "terminationGracePeriodSeconds" in err and "drainTimeoutSeconds" in err


# ---------------------------------------------------------------- credentials


def test_credentials_are_references_never_values(helm, tmp_path):
    out = helm_template(helm, tmp_path, EVERYTHING)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert "Secret" not in {d["kind"] for d in docs}
    pods = [one(docs, "DaemonSet")["spec"]["template"]["spec"],
            one(docs, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"]]
    for pod in pods:
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert "value" not in env[key]
            assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "ckpt-s3-creds", "key": key}
    # no key material, and no credential settings in the config file
    assert not re.search(r"AKIA[0-9A-Z]{16}|aws_secret_access_key|secret_key|access_key", out.stdout)
    conf_keys = {k for table in ckptfs_toml(docs).values() if isinstance(table, dict) for k in table}
    assert not {k for k in conf_keys | set(ckptfs_toml(docs)) if "secret" in k or "key" in k}

    # IRSA / Workload Identity: only service-account annotations, no env at all
    irsa = render(helm, tmp_path, {"serviceAccount": {"annotations": {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/ckptfs"}}})
    sa = one(irsa, "ServiceAccount")
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith("role/ckptfs")
    assert one(irsa, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    assert "env" not in gateway(irsa)


ROLE = "arn:aws:iam::123456789012:role/ckptfs"


@pytest.mark.parametrize("mode", ["irsa", "podIdentity", "existingSecret"])
def test_each_credentials_source_renders_only_its_own_provider(helm, tmp_path, mode):
    """s3.credentials: IRSA (the role annotation), EKS Pod Identity (an association made outside
    the chart: no annotation, no Secret, NOTES names the command) or an existing Secret; the
    gateway and the lifecycle CronJob alike."""
    values = {"s3": {"bucketUrl": BUCKET, "credentials": mode}, "lifecycle": {"rules": LIFECYCLE_RULES,
                                                                             "cronJob": {"enabled": True}}}
    if mode == "irsa":
        values["serviceAccount"] = {"annotations": {"eks.amazonaws.com/role-arn": ROLE}}
    if mode == "existingSecret":
        values["s3"]["existingSecret"] = "ckpt-s3-creds"
    out = helm_template(helm, tmp_path, values)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    sa = one(docs, "ServiceAccount")
    annotations = sa["metadata"].get("annotations") or {}
    pods = [one(docs, "DaemonSet")["spec"]["template"]["spec"],
            one(docs, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"]]
    for pod in pods:
        assert pod["serviceAccountName"] == sa["metadata"]["name"]
        env = {e["name"] for e in pod["containers"][0].get("env") or []}
        assert ("AWS_ACCESS_KEY_ID" in env) == (mode == "existingSecret")
        # the webhooks of IRSA and Pod Identity set these; the chart never does
        assert not env & {"AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI"}
    assert ("eks.amazonaws.com/role-arn" in annotations) == (mode == "irsa")
    (tmp_path / "notes-values.yaml").write_text(yaml.safe_dump(values))
    notes = subprocess.run([str(helm), "install", "ckpt", str(CHART), "--namespace", "ml-infra", "--dry-run=client",
                            "-f", str(tmp_path / "notes-values.yaml")], capture_output=True, text=True, timeout=60)
    assert notes.returncode == 0, notes.stderr
    assert ("create-pod-identity-association" in notes.stdout) == (mode == "podIdentity")
    if mode == "podIdentity":
        assert f"--service-account {sa['metadata']['name']}" in notes.stdout


@pytest.mark.parametrize("s3, sa, words", [
    ({"credentials": "irsa"}, {}, ["s3.credentials is irsa", "eks.amazonaws.com/role-arn"]),
    ({"credentials": "existingSecret"}, {}, ["s3.existingSecret"]),
    ({"credentials": "podIdentity"}, {"annotations": {"eks.amazonaws.com/role-arn": ROLE}},
     ["podIdentity", "IRSA would win"]),
    ({"credentials": "podIdentity", "existingSecret": "x"}, {}, ["s3.existingSecret is set"]),
    ({"credentials": "iam"}, {}, ["/s3/credentials"]),
])
def test_a_credentials_source_without_what_it_needs_is_refused_naming_the_setting(helm, tmp_path, s3, sa, words):
    err = refused(helm, tmp_path, {"s3": {"bucketUrl": BUCKET, **s3}, "serviceAccount": sa})
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("s3_extra", [
    {"secretKey": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"},
    {"accessKey": "AKIAIOSFODNN7EXAMPLE"},
    {"secretAccessKey": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"},
])
def test_schema_refuses_inline_credentials(helm, tmp_path, s3_extra):
    err = refused(helm, tmp_path, {"s3": {"bucketUrl": BUCKET, **s3_extra}})
    (key,) = s3_extra
    assert f"'{key}' not allowed" in err
    assert s3_extra[key] not in err


# ---------------------------------------------------------------- schema


@pytest.mark.parametrize("bad, names", [
    ({"priorityClass": "x"}, ["priorityClass"]),                                       # misspelled top-level key
    ({"drain": {"concurency": 4}}, ["/drain", "concurency"]),                           # misspelled nested key
    ({"lifecycle": {"rules": {"keep_lastest": 3}}}, ["/lifecycle/rules", "keep_lastest"]),
    ({"mount": {"fsync": "sometimes"}}, ["/mount/fsync"]),
    ({"mount": {"fuseIoUring": "yes"}}, ["/mount/fuseIoUring"]),
    ({"drain": {"checksum": "crc16"}}, ["/drain/checksum"]),
    ({"shutdown": {"drainTimeoutSeconds": -5}}, ["/shutdown/drainTimeoutSeconds"]),
    ({"s3": {"bucketUrl": "https://bucket.s3.amazonaws.com/x"}}, ["/s3/bucketUrl"]),
    ({"s3": {"bucketUrl": ""}}, ["/s3/bucketUrl"]),
    ({"mount": {"path": "/ckpt"}}, ["/mount/path"]),                                    # parent would be /
    ({"metrics": {"serviceMonitor": {"enabled": "yes"}}}, ["/metrics/serviceMonitor/enabled"]),
])
def test_schema_refuses_bad_values_naming_the_key(helm, tmp_path, bad, names):
    err = refused(helm, tmp_path, _merge({"s3": {"bucketUrl": BUCKET}}, bad))
    assert "schema" in err
    for name in names:
        assert name in err, err


# ---------------------------------------------------------------- ckptfs.toml


def test_config_toml_parses_and_holds_only_known_settings(helm, tmp_path):
    docs = render(helm, tmp_path, {
        "s3": {"endpointUrl": "http://rgw:7480", "region": "eu-west-1"},
        "mount": {"fsync": "remote", "allowOther": False, "fuseIoUring": "on"},
        "cache": {"hostPath": "/nvme0/ckptfs", "maxSize": "1500GiB", "highWatermark": 0.85, "lowWatermark": 0.7,
                  "backpressureTimeoutSeconds": 120},
        "drain": {"settleSeconds": 2.5, "partSize": "128MiB", "concurrency": 16, "checksum": "crc64nvme",
                  "signPayload": True, "markers": ['.metadata', 'say "done"', "latest*"]},
        "lifecycle": {"rules": LIFECYCLE_RULES},
    })
    conf = ckptfs_toml(docs)
    for key, value in conf.items():
        if isinstance(value, dict):
            known = LIFECYCLE_KEYS if key == "lifecycle" else CKPTFS_TOML_KEYS[key]
            assert set(value) <= known, f"[{key}] has keys ckptfs refuses: {set(value) - known}"
        else:
            assert key in CKPTFS_TOML_KEYS[""], key
    assert conf["bucket_url"] == BUCKET
    assert conf["endpoint_url"] == "http://rgw:7480"
    assert conf["region"] == "eu-west-1"
    assert conf["mount"] == {"fsync": "remote", "allow_other": False, "fuse_io_uring": "on"}
    assert conf["cache"] == {"dir": "/nvme0/ckptfs", "max_size": "1500GiB", "high_watermark": 0.85,
                             "low_watermark": 0.7, "backpressure_timeout": 120.0}
    assert conf["drain"] == {"settle_seconds": 2.5, "part_size": "128MiB", "concurrency": 16,
                             "markers": [".metadata", 'say "done"', "latest*"], "checksum": "crc64nvme",
                             "sign_payload": True}
    assert conf["lifecycle"] == LIFECYCLE_RULES
    assert isinstance(conf["lifecycle"]["keep_latest"], int)  # not 3.0: lifecycle wants integers

    # and ckptfs itself accepts it: settings and lifecycle rules validate as the gateway would
    path = tmp_path / "ckptfs.toml"
    path.write_text(docs_toml_text(docs))
    settings = build_settings(str(path), {})
    assert (settings.fsync, settings.part_size, settings.checksum) == ("remote", 128 << 20, "crc64nvme")
    assert settings.cache_cap_bytes(1 << 50) == 1500 << 30 and settings.watermarks() == (0.85, 0.7)
    assert settings.backpressure_timeout == 120
    assert rules_from_table(settings.lifecycle).keep_latest == LIFECYCLE_RULES["keep_latest"]

    # the gateway reads the file the ConfigMap provides, with the same cache dir
    c = gateway(docs)
    assert c["command"][c["command"].index("--cache-dir") + 1] == conf["cache"]["dir"]


def test_config_toml_defaults_have_no_optional_keys(helm, tmp_path):
    conf = ckptfs_toml(render(helm, tmp_path))
    assert "endpoint_url" not in conf and "region" not in conf and "lifecycle" not in conf
    assert conf["drain"]["part_size"] == "64MiB" and conf["drain"]["checksum"] == "auto"


# ---------------------------------------------------------------- lifecycle CronJob


def test_lifecycle_cronjob_is_unprivileged_and_shares_config_and_credentials(helm, tmp_path):
    assert "CronJob" not in {d["kind"] for d in render(helm, tmp_path)}
    docs = render(helm, tmp_path, _merge(EVERYTHING, {"lifecycle": {"cronJob": {"schedule": "5 3 * * *"}}}))
    cj = one(docs, "CronJob")
    assert cj["spec"]["schedule"] == "5 3 * * *"
    assert cj["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["ckptfs", "lifecycle", "apply", "--config", "/etc/ckptfs/ckptfs.toml"]
    assert c["image"] == gateway(docs)["image"]
    assert c["securityContext"]["privileged"] is False
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert not any("hostPath" in v for v in pod["volumes"])
    assert pod["serviceAccountName"] == one(docs, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"]
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == one(docs, "DaemonSet")["metadata"]["name"]


# ---------------------------------------------------------------- dashboard and metric names


def _metric_names(text: str) -> set[str]:
    return set(re.findall(r"\bckptfs_[a-z0-9_]+", text))


def _check_against_contract(names: set[str], where: str) -> None:
    for name in names:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if base != name:
            assert METRIC_CONTRACT.get(base) == "histogram", f"{where}: {name}: {base} is not a histogram"
        else:
            assert name in METRIC_CONTRACT, f"{where}: {name} is not in the metrics contract"
            assert METRIC_CONTRACT[name] != "histogram", f"{where}: use {name}_bucket, not the bare histogram"


def test_dashboard_uses_only_contract_metrics_and_covers_them(helm, tmp_path):
    dashboard = json.loads((CHART / "dashboards" / "ckptfs.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and all(e.strip() for e in exprs)
    names = set().union(*(_metric_names(e) for e in exprs))
    _check_against_contract(names, "dashboard")
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}
    assert used == set(METRIC_CONTRACT), f"not on the dashboard: {set(METRIC_CONTRACT) - used}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("backlog", "oldest dirty", "time to durable", "throughput", "error", "cache", "backpressure",
                  "fuse", "data path", "drain restarts"):
        assert topic in titles, topic

    # the optional ConfigMap ships that file, labelled for the Grafana sidecar
    assert not any(d["metadata"]["name"].endswith("-dashboard") for d in render(helm, tmp_path))
    cm = next(d for d in render(helm, tmp_path, EVERYTHING) if d["metadata"]["name"].endswith("-dashboard"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["ckptfs.json"]) == dashboard


def test_alerts_use_only_contract_metrics(helm, tmp_path):
    rule = one(render(helm, tmp_path, EVERYTHING), "PrometheusRule")
    for g in rule["spec"]["groups"]:
        for r in g["rules"]:
            names = _metric_names(r["expr"])
            assert names, r["alert"]
            _check_against_contract(names, r["alert"])
