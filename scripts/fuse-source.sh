# Sourced by scripts/build-fuse.sh and scripts/build-fuse-references.sh: the source of Debian
# 13's fuse3 package (libfuse 3.17), and meson + ninja from PyPI to build it. Each function
# logs through the caller's run() and fail().

FUSE_SUITE=trixie              # Debian release whose fuse3 source package has libfuse >= 3.17

# fuse_build_tools PY DIR: a small venv with meson and ninja (never the project's venv).
fuse_build_tools() {
  local py=$1 bt=$2
  [[ -x $bt/bin/meson && -x $bt/bin/ninja ]] || {
    run "$py" -m venv --clear --without-pip "$bt"
    run "$py" -m pip --python "$bt/bin/python" install -q meson ninja
  }
}

# fuse_fetch_source DEST SCRATCH: the unpacked source (Debian's patches applied) in DEST,
# through a private sources list. The system's apt configuration is only read: its apt.conf.d
# (proxy settings, etc.) still applies, and the mirror is the one it uses for Debian.
fuse_fetch_source() {
  local dest=$1 a=$2/apt mirror dsc
  mirror=${DEBIAN_MIRROR:-$( { cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null || true; } \
             | grep -oE '^(URIs:|deb(-src)?( \[[^]]*\])?) +https?://[^ ]+/debian/?( |$)' \
             | grep -oE 'https?://[^ ]+' | head -n1 || true)}
  mirror=${mirror:-http://deb.debian.org/debian}
  rm -rf "$a"; mkdir -p "$a/lists/partial" "$a/cache/archives/partial" "$a/src"
  echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${mirror%/} $FUSE_SUITE main" \
    >"$a/sources.list"
  local aopt=(-o "Dir::Etc::sourcelist=$a/sources.list" -o Dir::Etc::sourceparts=- \
              -o "Dir::State::Lists=$a/lists" -o "Dir::Cache=$a/cache" -o APT::Sandbox::User=root \
              -o Debug::NoLocking=1 -q)
  run apt-get "${aopt[@]}" update
  echo "+ [${SECONDS}s] apt-get source --download-only fuse3" >>"$LOG"
  (cd "$a/src" && apt-get "${aopt[@]}" source --download-only fuse3) >>"$LOG" 2>&1 \
    || fail "apt-get source fuse3 ($FUSE_SUITE) failed"
  dsc=$(ls "$a"/src/fuse3_*.dsc | head -n1)
  run rm -rf "$dest"
  run dpkg-source -x "$dsc" "$dest"     # also applies Debian's patches
  run rm -rf "$a"
}
