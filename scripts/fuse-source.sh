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

# debian_mirror [SOURCELIST SOURCEPARTS CODENAME]: the URL of the Debian archive the system's apt
# configuration uses, read from its one-line sources (sources.list, *.list) and its deb822
# sources (*.sources): the first enabled deb/deb-src entry for this release's own suite
# (CODENAME exactly, not -updates or -security) with the main component. By default the files
# are where apt-config says and CODENAME is VERSION_CODENAME of /etc/os-release. Prints
# nothing when there is none.
debian_mirror() {
  local list=${1-} parts=${2-} codename=${3-} SL SP
  if [[ -z $list && -z $parts ]]; then
    eval "$(apt-config shell SL Dir::Etc::sourcelist/f SP Dir::Etc::sourceparts/d 2>/dev/null)"
    list=${SL:-/etc/apt/sources.list} parts=${SP:-/etc/apt/sources.list.d}
  fi
  [[ -n $codename ]] || codename=$( . /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
  local one=() deb822=()
  [[ -f $list ]] && one+=("$list")
  for f in "${parts%/}"/*.list; do [[ -f $f ]] && one+=("$f"); done
  for f in "${parts%/}"/*.sources; do [[ -f $f ]] && deb822+=("$f"); done
  {
    # one-line: deb [options] URI SUITE COMPONENT...
    (( ${#one[@]} )) && awk -v cn="$codename" '
      { sub(/#.*/, "") }
      $1 == "deb" || $1 == "deb-src" {
        i = 2
        if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
        if ($(i + 1) != cn) next
        for (j = i + 2; j <= NF; j++) if ($j == "main") { print $i; break }
      }' "${one[@]}"
    # deb822: stanzas of Types, URIs, Suites, Components (and Enabled) fields
    (( ${#deb822[@]} )) && awk -v cn="$codename" '
      function flush() {
        if (types ~ /(^| )deb(-src)?( |$)/ && enabled != "no" && (" " suites " ") ~ (" " cn " ") \
            && (" " comps " ") ~ / main /) { split(uris, u, " "); print u[1] }
        types = uris = suites = comps = enabled = ""
      }
      FNR == 1 { flush() }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      { line = $0; key = tolower(line); sub(/:.*/, "", key); sub(/^[^:]*:[ \t]*/, "", line) }
      key == "types" { types = line } key == "uris" { uris = line } key == "suites" { suites = line }
      key == "components" { comps = line } key == "enabled" { enabled = tolower(line) }
      END { flush() }' "${deb822[@]}"
  } | grep -E '^(https?|file)://' | head -n1 || true
}

# fuse_fetch_source DEST SCRATCH: the unpacked source (Debian's patches applied) in DEST,
# through a private sources list. The system's apt configuration is only read: its apt.conf.d
# (proxy settings, etc.) still applies, and the mirror is the one it uses for Debian
# (debian_mirror), or DEBIAN_MIRROR where set. No mirror is assumed.
fuse_fetch_source() {
  local dest=$1 a=$2/apt mirror dsc
  mirror=${DEBIAN_MIRROR:-$(debian_mirror)}
  [[ -n $mirror ]] || fail "no Debian mirror in the apt configuration (no enabled deb or deb-src entry" \
    "for suite '$( . /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-?}")' with component main in" \
    "sources.list, *.list or *.sources): set DEBIAN_MIRROR to the URL of a Debian archive mirror"
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
