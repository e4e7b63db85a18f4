"""The batchnorm family's plane splits (issue 31) leave the programs of shapes whose planes are
whole vectors as they were: stored winners and recorded spaces were measured with those.

For a sample of configs of every operator and dtype at a shape every vector width divides (and
one whose H*W = 196 only some widths divide), the rendered source's translation unit after the
C preprocessor (host and sm_90 device passes, as ``benchmarks/relabel_results.py --compare
preprocessed`` compares them) must hash to what the code before the plane splits gave:
tests/data/batchnorm_aligned_sources.json, written by this module run as a script
(``python3 tests/kernels/test_batchnorm_aligned_sources.py --write``) under that code. A change
that alters these programs on purpose re-measures or relabels the results, then rewrites the
file."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

OPERATORS = (
    "batchnorm_stats",
    "batchnorm",
    "batchnorm_backward",
    "batchnorm_relu",
    "batchnorm_add_relu",
    "batchnorm_relu_backward",
    "batchnorm_add_relu_backward",
)
#: H*W = 64: every vector width divides it; 196: 1, 2 and 4 do, 8 does not.
SHAPES = ((4, 8, 8, 8), (4, 8, 14, 14))
PINNED = Path(__file__).resolve().parents[1] / "data" / "batchnorm_aligned_sources.json"
_INCLUDE = re.compile(r"^\s*#\s*include\s*(.*)$", re.M)


def sample(spec, dtype: str, shape: tuple[int, ...]) -> list[dict]:
    """Valid configs of ``spec`` at ``shape`` whose vector widths all divide H*W: what selects
    code in the templates (each VEC, APPLY_VEC the same or the widest, both places of the
    elementwise pass) and one 512-thread, MIN_BLOCKS 2 config (a min-blocks clause)."""
    hw = shape[2] * shape[3]
    widths = [v for v in spec.params["VEC"] if hw % v == 0]
    base = {"BLOCK_SIZE": 256, "UNROLL": 2, "STRATEGY": 1, "SPLIT": 1, "MIN_BLOCKS": 0}
    if "APPLY" not in spec.params:  # batchnorm_stats
        configs = [{**base, "VEC": vec} for vec in widths]
    else:
        configs = [
            {**base, "VEC": vec, "APPLY": apply, "APPLY_BLOCK": 256, "APPLY_VEC": avec}
            for vec in widths
            for avec in sorted({vec, widths[-1]})
            for apply in (0, 1)
        ]
    configs.append({**configs[-1], "BLOCK_SIZE": 512, "MIN_BLOCKS": 2})
    return [c for c in configs if spec.check(c, shape, dtype) is None]


def preprocessed(source: str) -> str:
    """sha256 of the translation unit as relabel_results.py's ``preprocessed`` makes it."""
    body = _INCLUDE.sub(lambda m: "KATO_INCLUDE " + m.group(1), source)
    units = []
    for flags in ([], ["-D__CUDACC__", "-D__CUDA_ARCH__=900"]):
        out = subprocess.run(
            ["cpp", "-P", "-w", "-x", "c++", *flags],
            input=body,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        lines = (" ".join(line.split()) for line in out.splitlines() if line.strip())
        units.append("\n".join(lines))
    return hashlib.sha256("\0".join(units).encode()).hexdigest()


def digests() -> dict[str, str]:
    """Every sampled config's key (operator, dtype, shape, config) and its digest."""
    from kato.kernels import get_operator

    sources = {}
    for name in OPERATORS:
        spec = get_operator(name)
        for dtype in spec.dtypes:
            for shape in SHAPES:
                for config in sample(spec, dtype, shape):
                    key = json.dumps([name, dtype, shape, config], sort_keys=True)
                    sources[key] = spec.render(config, shape, dtype)
    distinct = sorted(set(sources.values()))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        hashed = dict(zip(distinct, pool.map(preprocessed, distinct), strict=True))
    return {key: hashed[source] for key, source in sources.items()}


@pytest.mark.skipif(shutil.which("cpp") is None, reason="needs the C preprocessor")
def test_aligned_planes_compile_to_the_programs_recorded_results_were_measured_with() -> None:
    pinned = json.loads(PINNED.read_text())
    now = digests()
    assert len(pinned) >= 200
    assert set(now) == set(pinned)  # the same sample (check() accepts what it did)
    changed = [key for key in pinned if now[key] != pinned[key]]
    assert not changed, f"{len(changed)} of {len(pinned)} programs changed: {changed[:3]}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: test_batchnorm_aligned_sources.py --write")
    PINNED.write_text(json.dumps(digests(), indent=0, sort_keys=True) + "\n")
