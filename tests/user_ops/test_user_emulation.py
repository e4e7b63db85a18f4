"""A user operator's template run on the CPU (tests/kernels/cuda_emulation.py) with Kato's
Kernel Tuner-style macros and geometry, for variants of every block size and tile: each must
write every output element and match a float64 reference. Then the reference kernel itself,
as an operator of its own, must match the same reference: what the GPU backend relies on when
it takes the reference kernel's outputs as the references."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from kato.kernels.user import definition, load_folder
from kato.kernels.user.spec import UserOperatorSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from cuda_emulation import Case, cuda_include_dir, run_cases  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or cuda_include_dir() is None, reason="needs g++ and CUDA headers"
)


def _reference(args, shape, dtype):
    return [args[1].astype(np.float64) + args[2]]


def test_variants_and_reference_kernel_match(vector_add_dir, tmp_path):
    d = load_folder(vector_add_dir)
    op = UserOperatorSpec(d, reference=_reference, source_dir=vector_add_dir)
    # The reference kernel as an operator: its template is reference.cu, its block and grid
    # the [reference] section's (block 256, grid ceil(n / 256)).
    ref_spec = d.spec.model_dump() | {
        "name": "vector_add_reference_op",
        "template": "reference.cu",
        "kernel_name": "vector_add_reference",
        "tune_params": {"block_size_x": [256]},
        "restrictions": [],
        "grid_div_x": None,
    }
    ref_op = UserOperatorSpec(
        definition(ref_spec, {"reference.cu": d.files["reference.cu"]}),
        reference=_reference,
        source_dir=vector_add_dir,
    )
    n = 3001  # no multiple of a block or a tile
    cases = [
        Case(op, {"block_size_x": b, "tile_size_x": t}, (n,), "float32")
        for b, t in [(32, 1), (64, 8), (128, 4), (256, 2), (1024, 1), (512, 8)]
    ]
    cases.append(Case(ref_op, {"block_size_x": 256}, (n,), "float32"))
    failures = run_cases(cases, tmp_path, np.random.default_rng(0), binaries=1)
    assert not failures, failures
