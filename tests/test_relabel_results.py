"""benchmarks/relabel_results.py describes the base commit's kernels from a git archive: that
archive must import as ``kato.kernels`` (the package spans the checkout's folders)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO


@pytest.mark.parametrize("compare", ["source", "preprocessed"])
def test_a_committed_winner_is_described_at_the_base_commit_and_now(
    tmp_path: Path, compare: str
) -> None:
    if not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (it archives HEAD's kernels)")
    winner = sorted((REPO / "data" / "h200").glob("relu_*.t4.json"))[0]
    copy = tmp_path / winner.name
    shutil.copy(winner, copy)
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/relabel_results.py",
            "--dry-run",
            "--compare",
            compare,
            str(copy),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^\d+ relabelled, \d+ current, 0 to measure again$", done.stdout, re.M)
    assert copy.read_bytes() == winner.read_bytes()  # a dry run writes nothing
