"""The package layout: one import package, and dependencies that point one way.

The import-linter contracts live in pyproject.toml. They are checked against a regular
(non-editable) install of the project, which is also what a user's site-packages holds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(REPO)],
        check=True, capture_output=True, text=True,
    )
    return target


def lint_imports(site: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
                          cwd=site, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True)


def test_only_ckptfs_is_installed_at_the_top_level(installed):
    top = {p.name for p in installed.iterdir() if p.name not in ("bin", "__pycache__")}
    assert {n for n in top if not n.endswith(".dist-info")} == {"ckptfs"}
    assert {p.name for p in (installed / "ckptfs").iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "cli", "fsmeta", "drain", "gateway", "lifecycle"}


def test_layer_contracts_hold(installed):
    result = lint_imports(installed)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, imports", [
    ("fsmeta/txn.py", "import ckptfs.drain.store"),  # a lower layer reaching up
    ("gateway/errors.py", "import ckptfs.lifecycle.rules"),  # siblings must stay independent
    ("drain/schedule.py", "import ckptfs_fuse"),  # FUSE outside the gateway
])
def test_a_wrong_import_breaks_a_contract(installed, tmp_path, module, imports):
    site = tmp_path / "site"
    shutil.copytree(installed, site)
    path = site / "ckptfs" / module
    path.write_text(path.read_text() + f"\n{imports}  # injected by the test\n")
    result = lint_imports(site)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout


def test_old_top_level_names_are_not_importable():
    for name in ("gateway", "drain", "fsmeta", "lifecycle"):
        result = subprocess.run([sys.executable, "-c", f"import {name}"], cwd="/", capture_output=True, text=True)
        assert result.returncode != 0, f"import {name} worked"
    result = subprocess.run([sys.executable, "-c", "import ckptfs.gateway, ckptfs.cli"], cwd="/",
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
