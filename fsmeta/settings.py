"""Settings: TOML file, overridden by command-line flags, validated with messages that name the setting.

A cache directory remembers the settings it was mounted with (fsmeta ``meta/settings``),
so ``ckptfs drain --cache-dir DIR`` needs nothing else. Settings live in fsmeta, the
bottom layer, because every process reads them back from there; the bucket-URL and
address parsers are here for the same reason.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import tomllib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from urllib.parse import unquote, urlparse, urlsplit

# Commit markers: files a checkpoint writer creates last. The drain uploads them after every
# other file below their directory, the lifecycle engine calls a checkpoint complete once one exists.
DEFAULT_MARKERS = [".metadata", "latest*", "commit_success.txt", "*COMPLETE*"]


def is_marker_name(name: str, patterns: Iterable[str]) -> bool:
    """Whether a file name (not a path) matches one of the marker globs."""
    return _markers_regex(tuple(patterns))(name) is not None


@functools.lru_cache(maxsize=16)
def _markers_regex(patterns: tuple[str, ...]):
    # One regex for all the globs (fnmatchcase's own translation): the drain asks this of
    # every pending file at every scan, several times a second.
    return re.compile("|".join(fnmatch.translate(p) for p in patterns) or "(?!)").match

MIB = 1 << 20
GIB = 1 << 30


# Per-part checksum modes of the drain (``auto``: crc32c when the hardware has it, else crc32).
CHECKSUMS = ("auto", "crc32", "crc32c", "crc64nvme", "sha256", "md5", "none")


# The gateway's data path (``[mount] data_path``): passthrough when the kernel grants it
# (``auto``), required (``passthrough``: refuse to mount otherwise), or the writeback cache.
DATA_PATHS = ("auto", "passthrough", "writeback")

# How FUSE requests reach the gateway (``[mount] fuse_io_uring``): through io_uring queues, one
# per CPU, where the kernel offers them (``auto``), required (``on``: refuse to mount
# otherwise), or through /dev/fuse alone (``off``). See docs/OPERATIONS.md.
FUSE_IO_URING_MODES = ("auto", "on", "off")


# Cache space defaults (docs/OPERATIONS.md): cap at 90% of the cache device, evict clean
# files from 90% of the cap down to 80%, writers wait up to 10 minutes for room.
DEFAULT_CACHE_MAX_SIZE = "90%"
DEFAULT_HIGH_WATERMARK = 0.9
DEFAULT_LOW_WATERMARK = 0.8
DEFAULT_BACKPRESSURE_TIMEOUT = 600.0
DEFAULT_PUBLISH_TIMEOUT = 30.0  # [cluster] publish_timeout (fsmeta/cluster.py)
DEFAULT_NODE_TIMEOUT = 300.0  # [cluster] node_timeout


class ConfigError(ValueError):
    """A setting is wrong; the message starts with the setting's name."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(name: str, value) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size such as 64MiB, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            unit = (m.group(2) or "").upper()[:1]
            return int(float(m.group(1)) * _UNITS[unit])
    raise ConfigError(f"{name}: expected a size such as 64MiB or a byte count, got {value!r}")


_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_fraction(name: str, value) -> float:
    """A fraction in (0, 1]: ``0.9`` or ``"90%"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a fraction such as 0.9 or \"90%\", got {value!r}")
    fraction = None
    if isinstance(value, (int, float)):
        fraction = float(value)
    elif isinstance(value, str):
        m = _PERCENT.match(value)
        if m:
            fraction = float(m.group(1)) / 100
        elif re.fullmatch(r"\s*\d*\.?\d+\s*", value):  # from a command-line flag
            fraction = float(value)
    if fraction is None or not 0 < fraction <= 1:
        raise ConfigError(f"{name}: expected a fraction in (0, 1] such as 0.9 or \"90%\", got {value!r}")
    return fraction


def parse_cache_cap(name: str, value, device_bytes: int) -> int:
    """``[cache] max_size``: bytes (``"500GiB"``, an int) or a percentage of the cache
    device's size (``"80%"``), resolved against ``device_bytes``."""
    if isinstance(value, str) and "%" in value:
        try:
            return int(parse_fraction(name, value) * device_bytes)
        except ConfigError:
            raise ConfigError(f"{name}: a share of the cache device must be in (0%, 100%], got {value!r}") from None
    size = parse_size(name, value)
    if size <= 0:
        raise ConfigError(f"{name}: must be more than 0 bytes, got {value!r}")
    return size


# -- bucket URLs ------------------------------------------------------------------------

_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]$")


@dataclass(frozen=True)
class StoreURL:
    scheme: str  #: "s3" or "file"
    bucket: str | None  #: s3 only
    prefix: str  #: s3: "" or "a/b/" (always ends with "/"); file: ""
    path: str | None  #: file only: absolute directory

    def __str__(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.prefix}"
        return f"file://{self.path}"


def parse_store_url(url: str) -> StoreURL:
    """Parse ``s3://bucket[/prefix]`` or ``file:///abs/dir``.  Raises
    ValueError with a clear message (never echoing credentials)."""
    if not isinstance(url, str) or not url:
        raise ValueError("bucket URL must be a non-empty string like s3://bucket/prefix or file:///abs/dir")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if "@" in parts.netloc:
        raise ValueError(
            "bucket URL must not contain credentials (user:password@); use the standard "
            "AWS credential chain (env vars, profile, IRSA)"
        )
    if scheme == "s3":
        if parts.query or parts.fragment:
            raise ValueError(f"bucket URL {url!r} must not have a query string or fragment")
        bucket = parts.netloc
        if not bucket:
            raise ValueError(f"bucket URL {url!r} has no bucket name; expected s3://bucket[/prefix]")
        if ":" in bucket:
            raise ValueError(
                f"bucket URL {url!r}: put the endpoint in endpoint_url, not in the URL (expected s3://bucket[/prefix])"
            )
        if not _BUCKET_RE.match(bucket) or ".." in bucket:
            raise ValueError(f"bucket URL {url!r}: {bucket!r} is not a valid bucket name (3-255 chars of [A-Za-z0-9._-])")
        prefix = unquote(parts.path).strip("/")
        if prefix:
            comps = prefix.split("/")
            if any(c in ("", ".", "..") for c in comps):
                raise ValueError(f"bucket URL {url!r}: prefix {prefix!r} has empty, '.' or '..' components")
            prefix += "/"
        return StoreURL("s3", bucket, prefix, None)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file URL {url!r} must be file:///absolute/dir (got host {parts.netloc!r})")
        if parts.query or parts.fragment:
            raise ValueError(f"file URL {url!r} must not have a query string or fragment")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ValueError(f"file URL {url!r} must contain an absolute path: file:///abs/dir")
        norm = os.path.normpath(path)
        if norm == "/":
            raise ValueError("file URL must not point at the filesystem root")
        return StoreURL("file", None, "", norm)
    if not scheme:
        raise ValueError(f"bucket URL {url!r} has no scheme; expected s3://bucket[/prefix] or file:///abs/dir")
    raise ValueError(f"unsupported bucket URL scheme {scheme!r} in {url!r}; expected s3://bucket[/prefix] or file:///abs/dir")


def parse_bucket_url(url: str) -> tuple[str, str, str]:
    """``s3://bucket[/prefix]`` or ``file:///abs/dir`` -> (scheme, bucket or dir, prefix).

    The drain's parser decides what a URL means; on top of it, a mount insists on
    AWS bucket naming (lower case, 3-63 characters), which S3-compatible servers
    may relax but a training cluster moving between them should not depend on.
    """
    try:
        parsed = parse_store_url(url)
    except ValueError as exc:
        raise ConfigError(f"bucket_url: {exc}") from None
    if parsed.scheme == "file":
        return "file", parsed.path, ""
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", parsed.bucket):
        raise ConfigError(f"bucket_url: {url!r} does not name a valid S3 bucket (3-63 of a-z 0-9 . -)")
    return "s3", parsed.bucket, parsed.prefix.rstrip("/")


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics_addr: expected HOST:PORT, got {addr!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass
class Settings:
    bucket_url: str = ""
    cache_dir: str = "/var/cache/ckptfs"
    endpoint_url: str | None = None
    region: str | None = None
    fsync: str = "local"
    metrics_addr: str = "127.0.0.1:9810"
    allow_other: bool | None = None  # None: on when run as root
    data_path: str = "auto"  # auto | passthrough | writeback (gateway/passthrough.py)
    fuse_io_uring: str = "auto"  # auto | on | off (native/io_uring.c)
    # seconds a directory listing of the bucket answers lookups (incl. misses) before the
    # next one (gateway/listing.py)
    remote_ttl: float = 3.0
    # drain
    settle_seconds: float = 1.0
    part_size: int = 64 * MIB
    concurrency: int = 8
    markers: list = field(default_factory=lambda: list(DEFAULT_MARKERS))
    checksum: str = "auto"  # auto = crc32c (hardware) when available, else crc32
    sign_payload: bool = False  # True: SHA-256 payload signature (for servers that verify no checksum)
    # cache space (gateway/space.py): the cap, the eviction watermarks (fractions of the cap)
    # and how long a write waits for room before ENOSPC
    cache_max_size: str | int = DEFAULT_CACHE_MAX_SIZE
    cache_high_watermark: float | str = DEFAULT_HIGH_WATERMARK
    cache_low_watermark: float | str = DEFAULT_LOW_WATERMARK
    backpressure_timeout: float = DEFAULT_BACKPRESSURE_TIMEOUT
    # read path (gateway/fetch.py): ranged GETs of remote files into the cache
    read_part_size: int = 8 * MIB  # largest ranged GET
    read_max_readahead: int = 256 * MIB  # largest read-ahead window of a sequential reader
    read_concurrency: int = 16  # ranged GETs in flight, whole gateway
    # cluster commit (fsmeta/cluster.py): how long a request waits for its in-flight record to
    # be put in the bucket before it is acknowledged anyway (the gap is reported)
    publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT
    # seconds without a heartbeat after which a node holding a marker back shows as lost
    node_timeout: float = DEFAULT_NODE_TIMEOUT
    # raw [lifecycle] table, validated by lifecycle.rules
    lifecycle: dict = field(default_factory=dict)

    @property
    def key_prefix(self) -> str:
        scheme, _, prefix = parse_bucket_url(self.bucket_url)
        return prefix if scheme == "s3" else ""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Settings":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def validate(self) -> "Settings":
        if self.bucket_url:
            parse_bucket_url(self.bucket_url)
        if self.endpoint_url is not None:
            parsed = urlparse(self.endpoint_url)
            if "@" in parsed.netloc:
                # Never echo it: the part before '@' is a secret.
                raise ConfigError("endpoint_url: must not contain credentials (user:password@); use the "
                                  "AWS credential chain (environment, profile, IRSA)")
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ConfigError(f"endpoint_url: expected http(s)://host[:port], got {self.endpoint_url!r}")
        if self.data_path not in DATA_PATHS:
            raise ConfigError(f"mount.data_path: must be one of {', '.join(DATA_PATHS)}, got {self.data_path!r}")
        if self.fuse_io_uring not in FUSE_IO_URING_MODES:
            raise ConfigError(f"mount.fuse_io_uring: must be one of {', '.join(FUSE_IO_URING_MODES)}, "
                              f"got {self.fuse_io_uring!r}")
        if isinstance(self.remote_ttl, bool) or not isinstance(self.remote_ttl, (int, float)) \
                or not 0 <= float(self.remote_ttl) <= 86400:
            raise ConfigError(f"mount.remote_ttl: must be 0..86400 seconds, got {self.remote_ttl!r}")
        if self.fsync not in ("local", "remote"):
            raise ConfigError(f"fsync: must be 'local' or 'remote', got {self.fsync!r}")
        try:
            parse_addr(self.metrics_addr)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not os.path.isabs(self.cache_dir):
            raise ConfigError(f"cache_dir: must be an absolute path, got {self.cache_dir!r}")
        if not 0 <= float(self.settle_seconds) <= 3600:
            raise ConfigError(f"drain.settle_seconds: must be 0..3600, got {self.settle_seconds!r}")
        if not 5 * MIB <= int(self.part_size) <= 5 * GIB:
            raise ConfigError(f"drain.part_size: must be between 5MiB and 5GiB (S3 limits), got {self.part_size!r}")
        if not 1 <= int(self.concurrency) <= 256:
            raise ConfigError(f"drain.concurrency: must be 1..256, got {self.concurrency!r}")
        if not 64 * 1024 <= int(self.read_part_size) <= 1 * GIB:
            raise ConfigError(f"read.part_size: must be between 64KiB and 1GiB, got {self.read_part_size!r}")
        if not int(self.read_part_size) <= int(self.read_max_readahead) <= 64 * GIB:
            raise ConfigError(f"read.max_readahead: must be between read.part_size ({self.read_part_size}) "
                              f"and 64GiB, got {self.read_max_readahead!r}")
        if not 1 <= int(self.read_concurrency) <= 256:
            raise ConfigError(f"read.concurrency: must be 1..256, got {self.read_concurrency!r}")
        if not isinstance(self.markers, list) or not all(isinstance(m, str) and m for m in self.markers):
            raise ConfigError(f"drain.markers: must be a list of file-name patterns, got {self.markers!r}")
        if self.checksum not in CHECKSUMS:
            raise ConfigError(f"drain.checksum: must be one of {', '.join(CHECKSUMS)}, got {self.checksum!r}")
        parse_cache_cap("cache.max_size", self.cache_max_size, 1 << 40)
        high, low = self.watermarks()
        if low >= high:
            raise ConfigError(f"cache.low_watermark: must be below cache.high_watermark ({high:g}), "
                              f"got {self.cache_low_watermark!r}")
        timeout = self.backpressure_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise ConfigError(f"cache.backpressure_timeout: must be seconds in (0, 86400], got {timeout!r}")
        timeout = self.publish_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 86400:
            raise ConfigError(f"cluster.publish_timeout: must be seconds in [0, 86400], got {timeout!r}")
        timeout = self.node_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 4 <= timeout <= 7 * 86400:
            raise ConfigError(f"cluster.node_timeout: must be seconds in [4, 604800], got {timeout!r}")
        return self

    def watermarks(self) -> tuple[float, float]:
        """(high, low): fractions of the cache cap where eviction starts and where it stops."""
        return (parse_fraction("cache.high_watermark", self.cache_high_watermark),
                parse_fraction("cache.low_watermark", self.cache_low_watermark))

    def cache_cap_bytes(self, device_bytes: int) -> int:
        """The cache cap in bytes on a device of ``device_bytes``."""
        return parse_cache_cap("cache.max_size", self.cache_max_size, device_bytes)


# TOML layout: table -> {toml key: Settings field}
_TOML_KEYS = {
    "": {"bucket_url": "bucket_url", "endpoint_url": "endpoint_url", "region": "region"},
    "mount": {
        "fsync": "fsync",
        "metrics_addr": "metrics_addr",
        "allow_other": "allow_other",
        "data_path": "data_path",
        "fuse_io_uring": "fuse_io_uring",
        "remote_ttl": "remote_ttl",
        "endpoint_url": "endpoint_url",
        "region": "region",
    },
    "cache": {
        "dir": "cache_dir",
        "max_size": "cache_max_size",
        "high_watermark": "cache_high_watermark",
        "low_watermark": "cache_low_watermark",
        "backpressure_timeout": "backpressure_timeout",
    },
    "drain": {
        "settle_seconds": "settle_seconds",
        "part_size": "part_size",
        "concurrency": "concurrency",
        "markers": "markers",
        "checksum": "checksum",
        "sign_payload": "sign_payload",
    },
    "cluster": {
        "publish_timeout": "publish_timeout",
        "node_timeout": "node_timeout",
    },
    "read": {
        "part_size": "read_part_size",
        "max_readahead": "read_max_readahead",
        "concurrency": "read_concurrency",
    },
}

_TYPES = {
    "bucket_url": str, "endpoint_url": str, "region": str, "fsync": str, "metrics_addr": str,
    "allow_other": bool, "data_path": str, "fuse_io_uring": str, "remote_ttl": (int, float), "cache_dir": str,
    "settle_seconds": (int, float), "part_size": (str, int),
    "concurrency": int, "markers": list, "checksum": str, "sign_payload": bool,
    "cache_max_size": (str, int), "cache_high_watermark": (int, float, str), "cache_low_watermark": (int, float, str),
    "backpressure_timeout": (int, float),
    "read_part_size": (str, int), "read_max_readahead": (str, int), "read_concurrency": int,
    "publish_timeout": (int, float), "node_timeout": (int, float),
}


def load_toml(path: str) -> dict:
    """Read a config file into Settings field values; errors name the file and setting."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config: {path}: no such file") from None
    except PermissionError:
        raise ConfigError(f"config: {path}: permission denied") from None
    except IsADirectoryError:
        raise ConfigError(f"config: {path}: is a directory") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: {path}: invalid TOML: {exc}") from None
    values: dict = {}
    for key, value in data.items():
        if key == "lifecycle":
            if not isinstance(value, dict):
                raise ConfigError("lifecycle: must be a table")
            values["lifecycle"] = value
            continue
        if isinstance(value, dict):
            table = _TOML_KEYS.get(key)
            if table is None or key == "":
                raise ConfigError(f"{key}: unknown table (known: mount, cache, drain, read, cluster, lifecycle)")
            for sub, subvalue in value.items():
                name = f"{key}.{sub}"
                if sub not in table:
                    raise ConfigError(f"{name}: unknown setting (known: {', '.join(sorted(table))})")
                _set(values, name, table[sub], subvalue)
        else:
            if key not in _TOML_KEYS[""]:
                raise ConfigError(f"{key}: unknown setting")
            _set(values, key, _TOML_KEYS[""][key], value)
    return values


def _set(values: dict, name: str, attr: str, value) -> None:
    expected = _TYPES[attr]
    if isinstance(value, bool) and expected is not bool:
        raise ConfigError(f"{name}: unexpected boolean {value!r}")
    if not isinstance(value, expected):
        raise ConfigError(f"{name}: wrong type {type(value).__name__} ({value!r})")
    if attr in ("part_size", "read_part_size", "read_max_readahead"):
        value = parse_size(name, value)
    elif attr == "cache_max_size":
        parse_cache_cap(name, value, 1 << 40)  # refused here, by its TOML name
    elif attr in ("cache_high_watermark", "cache_low_watermark"):
        parse_fraction(name, value)
    values[attr] = value


def build_settings(config_path: str | None, overrides: dict) -> Settings:
    values = load_toml(config_path) if config_path else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    settings = Settings(**values)
    settings.cache_dir = os.path.abspath(settings.cache_dir)
    return settings.validate()
