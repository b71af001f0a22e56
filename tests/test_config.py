"""Settings: TOML file, flags override it, every refusal names the setting."""

from __future__ import annotations

import pytest

from ckptfs.fsmeta.settings import (
    DEFAULT_MARKERS,
    ConfigError,
    Settings,
    build_settings,
    load_toml,
    parse_bucket_url,
    parse_size,
)


def write(tmp_path, text: str) -> str:
    p = tmp_path / "ckptfs.toml"
    p.write_text(text)
    return str(p)


def test_full_config_file_is_read(tmp_path):
    path = write(tmp_path, f"""
bucket_url = "s3://my-bucket/runs"
endpoint_url = "http://127.0.0.1:9000"

[mount]
fsync = "remote"
metrics_addr = "0.0.0.0:9999"
allow_other = false

[cache]
dir = "{tmp_path}/cache"

[drain]
settle_seconds = 2.5
part_size = "128MiB"
concurrency = 16
markers = [".metadata", "DONE"]
checksum = "crc32c"

[lifecycle]
keep_last = 3
""")
    s = build_settings(path, {})
    assert s.bucket_url == "s3://my-bucket/runs" and s.key_prefix == "runs"
    assert s.endpoint_url == "http://127.0.0.1:9000"
    assert (s.fsync, s.metrics_addr, s.allow_other) == ("remote", "0.0.0.0:9999", False)
    assert s.cache_dir == f"{tmp_path}/cache"
    assert (s.settle_seconds, s.part_size, s.concurrency) == (2.5, 128 << 20, 16)
    assert s.markers == [".metadata", "DONE"] and s.checksum == "crc32c"
    assert s.lifecycle == {"keep_last": 3}


def test_flags_override_the_file(tmp_path):
    path = write(tmp_path, 'bucket_url = "s3://file-bucket"\n[mount]\nfsync = "remote"\n')
    s = build_settings(path, {"bucket_url": "file:///srv/bucket", "fsync": "local", "endpoint_url": None})
    assert s.bucket_url == "file:///srv/bucket" and s.fsync == "local"
    assert s.key_prefix == ""  # file:// buckets have no key prefix


def test_defaults():
    s = build_settings(None, {"bucket_url": "s3://abc"})
    assert s.fsync == "local" and s.metrics_addr == "127.0.0.1:9810"
    assert s.markers == DEFAULT_MARKERS and s.cache_dir == "/var/cache/ckptfs"
    assert s.allow_other is None  # decided at mount time: on when root


def test_relative_cache_dir_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = build_settings(None, {"bucket_url": "s3://abc", "cache_dir": "rel/cache"})
    assert s.cache_dir == str(tmp_path / "rel" / "cache")


@pytest.mark.parametrize("url, expected", [
    ("s3://bucket", ("s3", "bucket", "")),
    ("s3://bucket/a/b/", ("s3", "bucket", "a/b")),
    ("file:///srv/bucket/", ("file", "/srv/bucket", "")),
    ("file://localhost/srv/x", ("file", "/srv/x", "")),
])
def test_bucket_urls(url, expected):
    assert parse_bucket_url(url) == expected


@pytest.mark.parametrize("url", ["s3://UPPER", "s3://a", "s3://", "gs://bucket", "file://host/dir", "/abs/dir", ""])
def test_bad_bucket_urls_name_the_setting(url):
    with pytest.raises(ConfigError, match="^bucket_url: "):
        parse_bucket_url(url)


@pytest.mark.parametrize("text, setting", [
    ('[drain]\npart_size = "1MiB"', "drain.part_size"),
    ('[drain]\npart_size = "6GiB"', "drain.part_size"),
    ('[drain]\npart_size = "lots"', "drain.part_size"),
    ('[drain]\nconcurrency = 0', "drain.concurrency"),
    ('[drain]\nconcurrency = "8"', "drain.concurrency"),
    ('[drain]\nchecksum = "crc99"', "drain.checksum"),
    ('[drain]\nmarkers = ".metadata"', "drain.markers"),
    ('[drain]\nsettle_seconds = -1', "drain.settle_seconds"),
    ('[cache]\nmax_size = "150%"', "cache.max_size"),
    ('[cache]\nmax_size = "a lot"', "cache.max_size"),
    ('[cache]\nhigh_watermark = 2.0', "cache.high_watermark"),
    ('[cache]\nbackpressure_timeout = 0', "cache.backpressure_timeout"),
    ('[cache]\nbackpressure_timeout = "1m"', "cache.backpressure_timeout"),
    ('[cache]\nmax_size = 0', "cache.max_size"),
    ('[cache]\nmax_size = "0%"', "cache.max_size"),
    ('[cache]\nmax_size = true', "cache.max_size"),
    ('[cache]\nhigh_watermark = "95 percent"', "cache.high_watermark"),
    ('[cache]\nlow_watermark = 0', "cache.low_watermark"),
    ('[cache]\nlow_watermark = "90%"\nhigh_watermark = "80%"', "cache.low_watermark"),
    ('[cache]\nsize = 1', "cache.size"),
    ('[mount]\nfsync = "always"', "fsync"),
    ('[mount]\nallow_other = "yes"', "mount.allow_other"),
    ('[mount]\ndata_path = "fast"', "mount.data_path"),
    ('[mount]\ndata_path = true', "mount.data_path"),
    ('[mount]\nremote_ttl = -1', "mount.remote_ttl"),
    ('[mount]\nremote_ttl = "3s"', "mount.remote_ttl"),
    ('[mount]\nremote_ttl = true', "mount.remote_ttl"),
    ('[mount]\nmetrics_addr = "localhost"', "metrics_addr"),
    ('[mount]\nendpoint_url = "ftp://x"', "endpoint_url"),
    ('[nonsense]\nx = 1', "nonsense"),
    ('bucket = "s3://x"', "bucket"),
    ('lifecycle = 3', "lifecycle"),
])
def test_bad_settings_are_refused_by_name(tmp_path, text, setting):
    path = write(tmp_path, 'bucket_url = "s3://abc"\n' + text + "\n")
    with pytest.raises(ConfigError) as exc:
        build_settings(path, {})
    assert str(exc.value).startswith(setting + ":"), str(exc.value)


def test_unreadable_files_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_toml(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="is a directory"):
        load_toml(str(tmp_path))
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_toml(write(tmp_path, "x = [1,"))


@pytest.mark.parametrize("value, expected", [
    (123, 123), ("64MiB", 64 << 20), ("64M", 64 << 20), ("1.5GiB", 3 << 29), ("10 KB", 10 << 10), ("512", 512),
])
def test_sizes(value, expected):
    assert parse_size("x", value) == expected


@pytest.mark.parametrize("value", [True, "64 furlongs", None, 1.5])
def test_bad_sizes(value):
    with pytest.raises(ConfigError, match="^x: "):
        parse_size("x", value)


def test_settings_round_trip_through_json():
    s = build_settings(None, {"bucket_url": "s3://abc/p", "fsync": "remote"})
    data = s.to_json()
    data["from_a_newer_version"] = 1  # unknown keys are ignored by an older drain
    again = Settings.from_json(data)
    assert again == s


def test_credentials_in_the_endpoint_url_are_refused_without_echoing_them(tmp_path):
    path = write(tmp_path, 'bucket_url = "s3://abc"\nendpoint_url = "http://AKIAXX:s3cr3t@127.0.0.1:7480"\n')
    with pytest.raises(ConfigError) as exc:
        build_settings(path, {})
    assert str(exc.value).startswith("endpoint_url:")
    assert "s3cr3t" not in str(exc.value) and "AKIAXX" not in str(exc.value)


@pytest.mark.parametrize("value", ["auto", "passthrough", "writeback"])
def test_data_path_setting(tmp_path, value):
    path = write(tmp_path, f'bucket_url = "s3://abc"\n[mount]\ndata_path = "{value}"\n')
    assert build_settings(path, {}).data_path == value
    assert build_settings(None, {"bucket_url": "s3://abc"}).data_path == "auto"
    # the flag overrides the file
    assert build_settings(path, {"data_path": "writeback"}).data_path == "writeback"


def test_remote_ttl_setting(tmp_path):
    path = write(tmp_path, 'bucket_url = "s3://abc"\n[mount]\nremote_ttl = 0.5\n')
    assert build_settings(path, {}).remote_ttl == 0.5
    assert build_settings(None, {"bucket_url": "s3://abc"}).remote_ttl == 3.0  # a few seconds by default


def test_cache_space_settings_defaults_and_forms(tmp_path):
    s = build_settings(None, {"bucket_url": "s3://abc"})
    assert s.watermarks() == (0.9, 0.8) and s.backpressure_timeout == 600
    assert s.cache_cap_bytes(1000) == 900  # default cap: 90% of the cache device
    path = write(tmp_path, 'bucket_url = "s3://abc"\n[cache]\nmax_size = "500GiB"\nhigh_watermark = "95%"\n'
                           'low_watermark = 0.5\nbackpressure_timeout = 30\n')
    s = build_settings(path, {})
    assert s.cache_cap_bytes(1 << 50) == 500 << 30 and s.watermarks() == (0.95, 0.5)
    assert s.backpressure_timeout == 30
    s = build_settings(path, {"cache_max_size": "80%", "cache_high_watermark": "0.7", "backpressure_timeout": 2.5})
    assert s.cache_cap_bytes(1000) == 800 and s.watermarks() == (0.7, 0.5) and s.backpressure_timeout == 2.5
    assert build_settings(None, {"bucket_url": "s3://abc", "cache_max_size": 12345}).cache_cap_bytes(1) == 12345


def test_cache_space_flags_are_refused_by_name():
    with pytest.raises(ConfigError, match="^cache.max_size: "):
        build_settings(None, {"bucket_url": "s3://abc", "cache_max_size": "lots"})
    with pytest.raises(ConfigError, match="^cache.low_watermark: "):
        build_settings(None, {"bucket_url": "s3://abc", "cache_low_watermark": "0.95"})
    with pytest.raises(ConfigError, match="^cache.backpressure_timeout: "):
        build_settings(None, {"bucket_url": "s3://abc", "backpressure_timeout": -1.0})
