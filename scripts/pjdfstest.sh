#!/usr/bin/env bash
# Slow, opt-in: pjdfstest (POSIX conformance) on a plain directory and on a ckptfs mount of a
# file:// bucket, alternating, timed per test file. Not part of scripts/test.sh.
#
# Usage (as root: pjdfstest switches uids, and the mount needs allow_other):
#   scripts/pjdfstest.sh PJDFSTEST_DIR [--rounds N] [--only mount|plain] [--out DIR]
#                        [--fuse-io-uring off|on|auto] [--data-path auto|passthrough|writeback] [TEST ...]
#
# PJDFSTEST_DIR is a pjdfstest build: the directory holding the `pjdfstest` binary and `tests/`.
# pjdfstest is in neither PyPI nor Debian; docs/perf/pjdfstest.md says how to build it. TEST
# names files or directories below tests/ (chown/00.t, rename); default: all of them.
# The plain directory is made under ${TMPDIR:-/var/tmp} (set TMPDIR to choose its file system).
# Each round runs the plain directory, then a fresh mount (new bucket and cache directory);
# prove's output, with each file's time, goes to OUT/<round>-<plain|mount>.log, the gateway's
# log to OUT/<round>-gateway.log, its request counts and handler seconds by operation to
# OUT/<round>-metrics.txt; a table of totals and the slowest files ends the run.
# The FUSE transport is pinned (default off: /dev/fuse), not left to the kernel's enable_uring
# parameter, which another job on the machine may turn on or off meanwhile.
# Exit status: 0 when every run finished (failed pjdfstest assertions are reported, not fatal).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 1 ]] || usage
pjd=$(cd "$1" && pwd); shift
rounds=1 only="" out="" uring=off data_path=auto tests=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --fuse-io-uring) uring=$2; shift 2 ;;
    --data-path) data_path=$2; shift 2 ;;
    -h|--help) usage ;;
    *) tests+=("$1"); shift ;;
  esac
done
[[ -x $pjd/pjdfstest && -d $pjd/tests ]] || { echo "pjdfstest.sh: no pjdfstest build in $pjd (pjdfstest, tests/)" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "pjdfstest.sh: run as root (pjdfstest switches uids)" >&2; exit 2; }
command -v prove >/dev/null || { echo "pjdfstest.sh: needs prove (Debian: perl)" >&2; exit 2; }
[[ -x .venv/bin/ckptfs ]] || scripts/setup.sh
case "$only" in ""|mount|plain) ;; *) echo "pjdfstest.sh: --only mount|plain" >&2; exit 2 ;; esac

work=$(mktemp -d "${TMPDIR:-/var/tmp}/ckptfs-pjdfstest.XXXXXX")
out=${out:-$work/logs}
mkdir -p "$out"
mnt=$work/mnt
cleanup() {
  if mountpoint -q "$mnt" 2>/dev/null; then
    "$repo/.venv/bin/ckptfs" umount "$mnt" >/dev/null 2>&1 || fusermount3 -u "$mnt" || true
  fi
  rm -rf "$work/plain" "$work/bucket" "$work/cache" "$work/mnt"
  rmdir "$work" 2>/dev/null || true  # (kept when it holds the logs)
}
trap cleanup EXIT

paths=()
if [[ ${#tests[@]} -eq 0 ]]; then paths=("$pjd/tests"); else for t in "${tests[@]}"; do paths+=("$pjd/tests/$t"); done; fi

# One test file may take minutes (chown/00.t sleeps about 76 s by itself): the limit per file
# only stops a hang.
run_prove() {  # DIR LOG
  local start
  start=$(date +%s%N)
  (cd "$1" && prove -r --timer --exec "timeout 900 /bin/sh" "${paths[@]}") >"$2" 2>&1 || true
  echo "wallclock_ms $(( ($(date +%s%N) - start) / 1000000 ))" >>"$2"
}

for ((r = 1; r <= rounds; r++)); do
  if [[ $only != mount ]]; then
    mkdir -p "$work/plain"
    echo "== round $r: plain directory $work/plain ($(df -PT "$work/plain" | awk 'NR==2 {print $2}'))" >&2
    run_prove "$work/plain" "$out/$r-plain.log"
    rm -rf "$work/plain"
  fi
  if [[ $only != plain ]]; then
    mkdir -p "$mnt"
    echo "== round $r: ckptfs mount $mnt" >&2
    .venv/bin/ckptfs mount "file://$work/bucket" "$mnt" --cache-dir "$work/cache" --metrics-addr 127.0.0.1:0 \
      --fuse-io-uring "$uring" --data-path "$data_path"
    grep -E "data path:|FUSE requests:" "$work/cache/gateway.log" | sed 's/^.*ckptfs\.mount: /   /' >&2 || true
    run_prove "$mnt" "$out/$r-mount.log"
    .venv/bin/ckptfs status "$mnt" >"$out/$r-status.txt" 2>&1 || true
    metrics_url=$(grep -o 'metrics on http://[^ ]*' "$work/cache/gateway.log" | tail -1 | cut -d' ' -f3)
    [[ -z $metrics_url ]] || .venv/bin/python - "$metrics_url" >"$out/$r-metrics.txt" <<'PY' || true
import re, sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
ops = {}
for m in re.finditer(r'^ckptfs_fuse_request_duration_seconds_(count|sum)\{op="(\w+)"\} (\S+)$', text, re.M):
    ops.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
print(f"{'op':12s} {'requests':>9s} {'handler s':>10s} {'us/request':>10s}")
for op, v in sorted(ops.items(), key=lambda kv: -kv[1].get("sum", 0)):
    n, t = v.get("count", 0), v.get("sum", 0)
    if n:
        print(f"{op:12s} {int(n):9d} {t:10.2f} {t / n * 1e6:10.0f}")
print(f"{'total':12s} {int(sum(v.get('count', 0) for v in ops.values())):9d} {sum(v.get('sum', 0) for v in ops.values()):10.2f}")
for m in re.finditer(r'^(ckptfs_namespace_bucket_requests_total\{op="\w+"\}|ckptfs_fuse_dir_attrs_answered_total) (\S+)$', text, re.M):
    print(m.group(1), m.group(2))
PY
    .venv/bin/ckptfs umount "$mnt"
    cp "$work/cache/gateway.log" "$out/$r-gateway.log" 2>/dev/null || true
    rm -rf "$work/bucket" "$work/cache"
  fi
done

.venv/bin/python - "$out" <<'PY'
import glob, os, re, sys
out = sys.argv[1]
line = re.compile(r"^\[[\d:]+\] (\S+?)/tests/(\S+) \.+ ?(ok|skipped.*)?\s+(\d+) ms")
runs = {}
for log in sorted(glob.glob(os.path.join(out, "*-*.log"))):
    name = os.path.basename(log)[:-4]
    if name.endswith("-gateway"):
        continue
    files, wall, failed = {}, None, []
    text = open(log, errors="replace").read()
    for l in text.splitlines():
        m = line.match(l)
        if m:
            files[m.group(2)] = int(m.group(4))
        if l.startswith("wallclock_ms "):
            wall = int(l.split()[1]) / 1000
    failed = re.findall(r"^\S+/tests/(\S+)\s+\(Wstat", text, re.M)
    runs[name] = (files, wall, failed)
print(f"{'run':14s} {'wall s':>8s} {'files ok':>9s}  failed files")
for name, (files, wall, failed) in runs.items():
    print(f"{name:14s} {wall or 0:8.1f} {len(files):9d}  {' '.join(failed) or '-'}")
plain = [r for n, r in runs.items() if n.endswith("-plain")]
mount = [r for n, r in runs.items() if n.endswith("-mount")]
if plain and mount:
    def mean(rs, f):
        vals = [r[0][f] for r in rs if f in r[0]]
        return sum(vals) / len(vals) if vals else None
    common = [f for f in plain[0][0] if all(f in r[0] for r in plain + mount)]
    rows = sorted(((mean(mount, f) - mean(plain, f), f) for f in common), reverse=True)
    print(f"\nfiles that passed everywhere: {len(common)}, summed (mean of the rounds): "
          f"plain {sum(mean(plain, f) for f in common) / 1000:.1f} s, mount {sum(mean(mount, f) for f in common) / 1000:.1f} s")
    print("(a file pjdfstest skips on one file system, e.g. rename/22.t outside ext4/UFS/ZFS, counts as passed)")
    print("mean ms plain vs mount; most slower on the mount:")
    for diff, f in rows[:12]:
        print(f"  {f:22s} {mean(plain, f):9.0f} {mean(mount, f):9.0f}  {diff:+8.0f}")
PY
echo "logs: $out" >&2
