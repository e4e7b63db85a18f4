"""Every committed H200 winner (data/h200) passes the current verification on fresh inputs.

The winners are served as they are; a tighter tolerance, a new input design or a change in how
the backend verifies must not leave a served config that the current code would reject
(benchmarks/relabel_results.py carries winners over to a new version only when they render and
launch the same; this checks that they still verify)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kato.kernels import get_operator
from verify_harness import verify_config

DATA = Path(__file__).resolve().parents[2] / "data" / "h200"
WINNERS = [
    (path.name, best["config"])
    for path in sorted(DATA.glob("*.t4.json"))
    for best in json.loads(path.read_text())["metadata"]["kato"]["best"]
]


def test_there_are_winners_to_check():
    assert len(WINNERS) >= 40


@pytest.mark.parametrize(("name", "config"), WINNERS, ids=[w[0] for w in WINNERS])
def test_committed_winner_verifies(name, config):
    meta = json.loads((DATA / name).read_text())["metadata"]["kato"]
    spec = get_operator(meta["operator"])
    assert verify_config(spec, meta["shape"], meta["dtype"], config, seed=11) is None
