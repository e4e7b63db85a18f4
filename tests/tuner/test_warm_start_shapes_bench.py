"""benchmarks/warm_start_shapes.py: siblings are found by operator, version, dtype and GPU, and
the seeds come from the siblings as a job's warm start ranks the database's sources."""

from __future__ import annotations

import json

from paths import HOLDOUT_SPACES

from benchmarks import warm_start_shapes


def _space(stem: str) -> str:
    """The recorded space of ``stem`` whatever its version suffix (relabels rename files)."""
    (path,) = HOLDOUT_SPACES.glob(f"{stem}_*.json.gz")
    return str(path)


MATMUL_F32 = [
    _space("matmul_H200_4096x4096x4096_float32"),
    _space("matmul_H200_2048x2048x8192_float32"),
]
MATMUL_F16 = _space("matmul_H200_4096x4096x4096_float16")


def test_siblings_share_operator_version_dtype_and_gpu():
    groups = warm_start_shapes.sibling_groups([*MATMUL_F32, MATMUL_F16])
    # float16 at 4096^3 has no float16 sibling here; the float32 pair are each other's.
    assert groups == {MATMUL_F32[0]: [MATMUL_F32[1]], MATMUL_F32[1]: [MATMUL_F32[0]]}


def test_seeds_from_a_brute_forced_sibling_start_at_its_best(tmp_path):
    """Both float32 matmul shapes have the same fastest config: seeded from the other shape's
    whole file, the first measured config is the optimum, at every budget (with up to 10 seeds
    per sibling, the policy before one: a tenth of the budget)."""
    out = tmp_path / "w.json"
    report = warm_start_shapes.main(
        [*MATMUL_F32, "--no-recorded", "--source", "file", "--seeds", "2", "--budgets", "10,25"]
        + ["--per-source", "10", "--workers", "1", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report["targets"]) == {"h200-holdout/" + p.split("/")[-1][:-8] for p in MATMUL_F32}
    for entry in report["targets"].values():
        assert entry["10"]["seed_configs"] == 1 and entry["25"]["seed_configs"] == 3
        assert entry["10"]["seeds_alone_mean"] == 1.0
        assert entry["10"]["warm_mean"] == 1.0 and entry["25"]["warm_mean"] == 1.0
        assert entry["10"]["warm_per_seed"] == [1.0, 1.0]
        assert 0.0 < entry["10"]["cold_mean"] <= 1.0
    assert sum(report["summary"]["10"].values()) == 2 and report["per_source"] == 10


def test_job_sources_are_the_siblings_own_runs():
    """``--source job``: a sibling stands for its own default run of N configs, so the source
    holds exactly N measured configs (all OK on these spaces)."""
    sources = warm_start_shapes.sources_for(MATMUL_F32[0], [MATMUL_F32[1]], 0, "job", 20)
    assert len(sources) == 1 and len(sources[0].trials) == 20
    assert sources[0].distance == 3.0  # (4096, 4096, 4096) vs (2048, 2048, 8192): 1 + 1 + 1
