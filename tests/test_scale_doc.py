"""docs/SCALE.md is what scripts/scale_plan.py computes (no hand-edited figure drifts from it)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_scale_doc_is_the_scripts_output():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "scale_plan.py")], capture_output=True,
                            text=True, check=True)
    assert result.stdout == (REPO / "docs" / "SCALE.md").read_text(), \
        "docs/SCALE.md is stale: run python3 scripts/scale_plan.py > docs/SCALE.md"


def test_the_plan_reacts_to_its_inputs():
    def plan(*args: str) -> str:
        return subprocess.run([sys.executable, str(REPO / "scripts" / "scale_plan.py"), *args],
                              capture_output=True, text=True, check=True).stdout

    bigger_shards = plan("--nodes", "100")  # 500 GB over 800 ranks: 600 MiB shards, multipart
    assert "multipart, 10 parts" in bigger_shards
    assert "| write requests (PUT/POST) | 9,601 |" in bigger_shards  # 800 x (Create + 10 parts + Complete) + marker
