#!/usr/bin/env bash
# Set up (if needed) and show the main job: mount ckptfs on the embedded file://
# bucket, save a sharded checkpoint the way torch.save/DCP do (tmp + fsync +
# rename, commit marker last), and watch it drain into the bucket.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
CKPTFS=$PWD/.venv/bin/ckptfs
PY=$PWD/.venv/bin/python
DEMO=${CKPTFS_DEMO_DIR:-/var/tmp/ckptfs-demo}
MNT=$DEMO/mnt BUCKET=$DEMO/bucket CACHE=$DEMO/cache

mountpoint -q "$MNT" 2>/dev/null && fusermount3 -u "$MNT" || true
rm -rf "$DEMO"; mkdir -p "$MNT"
trap 'mountpoint -q "$MNT" && "$CKPTFS" umount "$MNT" >/dev/null 2>&1 || true' EXIT

echo "== ckptfs mount file://$BUCKET $MNT --cache-dir $CACHE"
"$CKPTFS" mount "file://$BUCKET" "$MNT" --cache-dir "$CACHE" --metrics-addr 127.0.0.1:0

echo "== writing a 4-shard checkpoint (4 x 64 MiB) to $MNT/run1/step_1000/"
"$PY" - "$MNT/run1/step_1000" <<'PY'
import os, sys, time
d = sys.argv[1]; os.makedirs(d, exist_ok=True)
t = time.perf_counter()
for rank in range(4):
    tmp, final = f"{d}/__{rank}_0.distcp.tmp", f"{d}/__{rank}_0.distcp"
    with open(tmp, "wb") as f:
        for _ in range(64):
            f.write(os.urandom(1 << 20))
        f.flush(); os.fsync(f.fileno())
    os.rename(tmp, final)
with open(f"{d}/.metadata", "wb") as f:      # the commit marker: drains last
    f.write(b"shards=4\n"); f.flush(); os.fsync(f.fileno())
print(f"   written and fsynced in {time.perf_counter() - t:.2f}s (acknowledged at local-disk speed)")
PY

echo "== right after the save:"
for f in "$MNT"/run1/step_1000/.metadata "$MNT"/run1/step_1000/__0_0.distcp; do
  printf '   %-40s %s\n' "${f#$MNT/}" "$(getfattr --absolute-names --only-values -n user.ckptfs.state "$f")"
done
"$CKPTFS" status "$MNT" | sed 's/^/   /'

echo "== ckptfs wait-durable $MNT/run1/step_1000"
"$CKPTFS" wait-durable "$MNT/run1/step_1000" --timeout 120
for f in "$MNT"/run1/step_1000/.metadata "$MNT"/run1/step_1000/__0_0.distcp; do
  printf '   %-40s %s\n' "${f#$MNT/}" "$(getfattr --absolute-names --only-values -n user.ckptfs.state "$f")"
done

echo "== the bucket ($BUCKET): one object per file, no .tmp names (object metadata sits in .ckptfs-m.* sidecars)"
(cd "$BUCKET" && find . -type f -not -path './.ckptfs*' -not -name '.ckptfs-*' -printf '   %-40P %s bytes\n' | sort)
echo "== blake3 of a shard, from the mount and from the object's metadata"
printf '   mount:  %s\n' "$(getfattr --absolute-names --only-values -n user.ckptfs.blake3 "$MNT/run1/step_1000/__0_0.distcp")"
"$PY" -c "import blake3,sys; print('   object:', blake3.blake3(open(sys.argv[1],'rb').read()).hexdigest())" "$BUCKET/run1/step_1000/__0_0.distcp"

echo "== ckptfs umount --wait-durable $MNT"
"$CKPTFS" umount "$MNT" --wait-durable --timeout 60

echo "== another node: the same bucket, an empty cache ($DEMO/cache-node2)"
"$CKPTFS" mount "file://$BUCKET" "$MNT" --cache-dir "$DEMO/cache-node2" --metrics-addr 127.0.0.1:0
ls -l "$MNT/run1/step_1000" | sed 's/^/   /'
echo "== ckptfs prefetch $MNT/run1/step_1000   (before a resume: fetch it in parallel, checked against blake3)"
"$CKPTFS" prefetch "$MNT/run1/step_1000" | sed 's/^/   /'
cmp "$MNT/run1/step_1000/__0_0.distcp" "$BUCKET/run1/step_1000/__0_0.distcp" \
  && echo "   __0_0.distcp reads back identical on the second node"
"$CKPTFS" umount "$MNT"
echo "done: demo files are in $DEMO"
