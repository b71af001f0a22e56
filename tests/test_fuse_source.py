"""scripts/fuse-source.sh: the Debian mirror libfuse's source is fetched from comes from the
system's apt configuration only (one-line and deb822 sources), or from DEBIAN_MIRROR; where
none is configured the set-up fails and says what to set. No mirror host is assumed."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "fuse-source.sh"


def mirror(tmp_path: Path, sources_list: str | None = None, **parts: str) -> str:
    """debian_mirror over a sources.list and a sources.list.d made of the given texts."""
    lst, d = tmp_path / "sources.list", tmp_path / "sources.list.d"
    d.mkdir(exist_ok=True)
    if sources_list is not None:
        lst.write_text(sources_list)
    for name, text in parts.items():
        (d / name.replace("_", ".")).write_text(text)
    r = subprocess.run(["bash", "-c", f'source {SCRIPT}; debian_mirror "$1" "$2" bookworm', "-", str(lst), str(d)],
                       capture_output=True, text=True, check=True)
    return r.stdout.strip()


def test_one_line_sources(tmp_path):
    assert mirror(tmp_path, "# deb http://old.example/debian bookworm main\n"
                            "deb http://sec.example/debian-security bookworm-security main\n"
                            "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian/ bookworm main contrib\n"
                            ) == "http://mirror.example/debian/"


def test_deb822_sources(tmp_path):
    assert mirror(tmp_path, None, debian_sources=(
        "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\nComponents: main\nEnabled: no\n\n"
        "# a comment\nTypes: deb deb-src\nURIs: http://m.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"),
        other_sources="Types: deb\nURIs: https://vendor.example/apt\nSuites: nodistro\nComponents: main\n",
    ) == "http://m.example/debian"


def test_files_apt_ignores_and_other_suites_are_not_read(tmp_path):
    assert mirror(tmp_path, "", vendor_list="deb http://vendor.example/apt stable main\n",
                  debian_sources_disabled="Types: deb\nURIs: http://x.example/debian\nSuites: bookworm\n"
                                          "Components: main\n") == ""


def test_no_mirror_configured_fails_saying_what_to_set(tmp_path):
    r = subprocess.run(["bash", "-c", f'fail() {{ echo "$*" >&2; exit 1; }}; source {SCRIPT}; '
                        'debian_mirror() { :; }; fuse_fetch_source "$1/src" "$1/scratch"', "-", str(tmp_path)],
                       capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "DEBIAN_MIRROR"})
    assert r.returncode == 1
    assert "DEBIAN_MIRROR" in r.stderr and "apt configuration" in r.stderr


def test_no_mirror_host_is_hard_coded():
    for path in (REPO / "scripts").iterdir():
        text = path.read_text(errors="replace")
        assert not re.search(r"deb\.debian\.org|ftp\.\w+\.debian\.org|https?://[\w.-]+/debian\b", text), path
