"""The add_rmsnorm spec: constraints (the register model of the first pass), defaults,
rendering (WB_REGS), launch geometry, problems, references (against torch: the sum rounded as
torch rounds it, the norm of s as stored) and tolerances."""

from __future__ import annotations

import math

import kato.kernels.add_rmsnorm as ar
import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, Launch, get_operator, list_operators
from kato.kernels.add_rmsnorm import AddRMSNormSpec, add_rmsnorm_reference
from kato.kernels.rmsnorm import EPS, RSTD_TOLERANCE

SPEC = get_operator("add_rmsnorm")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
SHAPES = [
    (1, 1),
    (1, 2),
    (3, 7),
    (1000, 1),
    (1048576, 128),
    (8192, 768),
    (8192, 4096),
    (3000, 3001),
    (1024, 50257),
    (16, 131072),
    (7, 1000003),
]


def cfg(block=256, vec=4, row_threads=0, cache=0, min_blocks=0, group_rows=1):
    return {
        "BLOCK_SIZE": block,
        "VEC": vec,
        "ROW_THREADS": row_threads,
        "CACHE": cache,
        "MIN_BLOCKS": min_blocks,
        "GROUP_ROWS": group_rows,
    }


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, AddRMSNormSpec) and SPEC in list_operators()
    assert SPEC.kernel_name == "add_rmsnorm_fwd" and SPEC.dtypes == DTYPE_NAMES
    assert list(SPEC.params) == [
        "BLOCK_SIZE",
        "VEC",
        "ROW_THREADS",
        "CACHE",
        "MIN_BLOCKS",
        "GROUP_ROWS",
    ]
    assert SPEC.space_size() == 4 * 4 * 4 * 3 * 2 * 3


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (64, 1024), "float32", "32-byte vector"),
        (cfg(block=1024, min_blocks=2), (64, 1024), "float32", "cap registers at 32"),
        (cfg(cache=1, vec=4), (64, 65536), "float32", "shared memory"),
        (cfg(cache=2, row_threads=32, vec=4), (64, 4096), "float32", "ITEMS=32"),
        (cfg(cache=2, block=1024, vec=4), (64, 16384), "float32", "would spill"),
        # 12 vectors of 4 per lane: s alone would fit 128 registers, with the loads it spills.
        (cfg(cache=2, row_threads=16, vec=4, min_blocks=2), (64, 768), "float32", "would spill"),
        (cfg(), (64, 1024), "int32", "does not support dtype"),
        (cfg(), (2**31, 64), "float32", "2**31-1 rows"),
        (cfg(group_rows=2), (64, 1024), "float32", "not one of"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


@pytest.mark.parametrize(
    ("config", "shape", "dtype"),
    [
        (cfg(vec=4), (64, 1022), "float32"),
        (cfg(vec=8, cache=2, row_threads=32), (64, 769), "bfloat16"),
        (cfg(vec=1), (7, 1000003), "float32"),
        (cfg(cache=1, vec=4), (64, 58000), "float32"),  # 232000 + 32 static bytes fit
        (cfg(cache=2, block=1024, vec=4), (64, 4096), "float32"),
    ],
)
def test_check_accepts(config, shape, dtype) -> None:
    assert SPEC.check(config, shape, dtype) is None


def test_register_model() -> None:
    """CACHE=2 holds s and, while its first pass runs, the x and residual vectors loaded ahead
    of the adds; the weight joins them only where every row has the same head and it fits."""
    c = cfg(cache=2, row_threads=32, vec=8)
    assert ar.load_registers(c, 768, 2) == 3 * 8
    assert ar.load_registers({**c, "CACHE": 0}, 768, 2) == 0
    assert SPEC.defines(c, (64, 768), "bfloat16")["WB_REGS"] == 1
    assert SPEC.defines(c, (64, 769), "bfloat16")["WB_REGS"] == 0  # heads move per row
    assert SPEC.defines({**c, "CACHE": 0}, (64, 768), "bfloat16")["WB_REGS"] == 0
    # 512 threads leave 128 registers: s of 16 floats and its loads fit, the weight beside
    # them at 32 floats not.
    big = cfg(cache=2, block=512, vec=4)
    assert SPEC.defines(big, (64, 8192), "float32")["WB_REGS"] == 1
    assert SPEC.check(big, (64, 16384), "float32") is None
    assert SPEC.defines(big, (64, 16384), "float32")["WB_REGS"] == 0


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_valid_for_every_shape(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert SPEC.check(config, shape, dtype) is None
    assert SPEC.launch(config, shape, dtype).grid[0] >= 1


def test_default_config_choices() -> None:
    short = SPEC.default_config((1048576, 128), "float32")
    assert (short["ROW_THREADS"], short["CACHE"], short["GROUP_ROWS"]) == (16, 2, 4)
    hidden = SPEC.default_config((8192, 768), "bfloat16")
    assert (hidden["VEC"], hidden["ROW_THREADS"], hidden["CACHE"]) == (8, 32, 2)
    assert SPEC.default_config((7, 1000003), "float32")["CACHE"] == 0
    with pytest.raises(InvalidInput):
        SPEC.default_config((4, 4), "int32")


def test_group_rows_is_launch_geometry_only() -> None:
    a, b = cfg(block=128, row_threads=32), cfg(block=128, row_threads=32, group_rows=16)
    assert SPEC.render(a, (1000, 128), "float32") == SPEC.render(b, (1000, 128), "float32")
    assert SPEC.launch(b, (1000, 128), "float32") == Launch(
        grid=(math.ceil(1000 / 64), 1, 1), block=(128, 1, 1)
    )


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    problem = SPEC.make_problem((37, 300), dtype, np.random.default_rng(1))
    x, res, w, s, y, rstd, rows, cols, eps = problem.args
    t = DTYPES[dtype][0]
    assert x.dtype == res.dtype == w.dtype == s.dtype == y.dtype == t and rstd.dtype == np.float32
    assert (rows, cols) == (37, 300) and eps == np.float32(EPS)
    assert problem.outputs == [3, 4, 5]
    for out in (s, y, rstd):
        assert np.isnan(out.astype(np.float64)).all()
    tol = SPEC.tolerance(dtype)
    assert problem.tolerances == [tol, tol, RSTD_TOLERANCE]
    x64, r64 = x.astype(np.float64), res.astype(np.float64)
    assert np.all(np.abs((x64 + r64)[0::4].mean(axis=1) - 1e3) < 5)  # squares past float16
    # Rows 2, 6, ...: the sum cancels to a small fraction of x.
    ratio = np.abs(x64 + r64).mean(axis=1) / np.abs(x64).mean(axis=1)
    assert np.all(ratio[2::4] < 0.1) and np.all(ratio[1::4] > 0.1)


def test_reference_matches_an_independent_computation() -> None:
    problem = SPEC.make_problem((5, 9), "bfloat16", np.random.default_rng(2))
    x, res, w = problem.args[:3]
    s_ref, y_ref, rstd_ref = problem.references
    np.testing.assert_array_equal(s_ref, x.astype(np.float64) + res.astype(np.float64))
    stored = s_ref.astype(x.dtype).astype(np.float64)
    for r in range(5):
        rstd = 1 / math.sqrt(sum(v * v for v in stored[r]) / 9 + EPS)
        assert rstd_ref[r] == pytest.approx(rstd, rel=1e-12)
        np.testing.assert_allclose(y_ref[r], stored[r] * rstd * w.astype(np.float64), rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_reference_equals_torch(dtype) -> None:
    """s rounds as torch's x + residual in the element type does, and y and rstd are torch's
    rms_norm of that s (computed in float64)."""
    torch = pytest.importorskip("torch")
    problem = SPEC.make_problem((6, 257), dtype, np.random.default_rng(4))
    x, res, w = problem.args[:3]
    s_ref, y_ref, rstd_ref = problem.references
    tdtype = getattr(torch, dtype)

    def t(a):
        return torch.tensor(a.astype(np.float32)).to(tdtype)

    s_torch = t(x) + t(res)
    np.testing.assert_array_equal(
        s_torch.to(torch.float64).numpy(), s_ref.astype(x.dtype).astype(np.float64)
    )
    s64 = s_torch.to(torch.float64)
    y_torch = torch.nn.functional.rms_norm(s64, (257,), t(w).to(torch.float64), EPS)
    np.testing.assert_allclose(y_ref, y_torch.numpy(), rtol=1e-12, atol=1e-14)
    rstd_torch = torch.rsqrt(s64.pow(2).mean(dim=1) + EPS)
    np.testing.assert_allclose(rstd_ref, rstd_torch.numpy(), rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_rounded_references_are_within_tolerance(dtype) -> None:
    problem = SPEC.make_problem((16, 1000), dtype, np.random.default_rng(8))
    for ref, (atol, rtol) in zip(problem.references[:2], problem.tolerances[:2], strict=True):
        ideal = ref.astype(DTYPES[dtype][0]).astype(np.float64)
        np.testing.assert_allclose(ideal, ref, atol=atol, rtol=rtol)
        assert not np.allclose(ref * (1 + 4 * rtol), ref, atol=atol, rtol=rtol)
    # y normalised from x alone (the residual dropped) fails.
    x, _, w = problem.args[:3]
    atol, rtol = problem.tolerances[1]
    wrong = add_rmsnorm_reference(x, np.zeros_like(x), w, EPS)[1]
    assert not np.allclose(wrong, problem.references[1], atol=atol, rtol=rtol)


def test_bytes_moved_and_buffers() -> None:
    assert SPEC.bytes_moved((8192, 768), "bfloat16") == 4 * 8192 * 768 * 2 + 768 * 2 + 4 * 8192
    problem = SPEC.make_problem((3, 5), "float32", np.random.default_rng(0))
    assert problem.nbytes == SPEC.buffer_bytes((3, 5), "float32")
