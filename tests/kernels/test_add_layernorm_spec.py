"""The add_layernorm spec: constraints (the register model of the first pass), defaults,
rendering (WB_REGS: weight and bias), launch geometry, problems, references (against torch: the
sum rounded as torch rounds it, layer_norm of s as stored) and tolerances."""

from __future__ import annotations

import math

import kato.kernels.add_layernorm as al
import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, Launch, get_operator, list_operators
from kato.kernels.add_layernorm import EPS, AddLayerNormSpec, add_layernorm_reference
from kato.kernels.layernorm import STATS_TOLERANCE

SPEC = get_operator("add_layernorm")
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
    assert isinstance(SPEC, AddLayerNormSpec) and SPEC in list_operators()
    assert SPEC.kernel_name == "add_layernorm_fwd" and SPEC.dtypes == DTYPE_NAMES
    assert list(SPEC.params)[-1] == "GROUP_ROWS"
    assert SPEC.space_size() == 4 * 4 * 4 * 3 * 2 * 3


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (64, 1024), "float32", "32-byte vector"),
        (cfg(cache=1, vec=4), (64, 65536), "float32", "shared memory"),
        (cfg(cache=2, row_threads=32, vec=4), (64, 4096), "float32", "ITEMS=32"),
        (cfg(cache=2, row_threads=16, vec=4, min_blocks=2), (64, 768), "float32", "would spill"),
        (cfg(), (64, 1024), "int32", "does not support dtype"),
        (cfg(group_rows=2), (64, 1024), "float32", "not one of"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


def test_register_model() -> None:
    """CACHE=2 holds s and its first pass's loads; weight and bias join them only where every
    row has the same head and they fit."""
    c = cfg(cache=2, row_threads=32, vec=8)
    assert al.load_registers(c, 768, 2) == 3 * 8
    assert al.load_registers({**c, "CACHE": 1}, 768, 2) == 0
    assert SPEC.defines(c, (64, 768), "bfloat16")["WB_REGS"] == 1
    assert SPEC.defines(c, (64, 769), "bfloat16")["WB_REGS"] == 0  # heads move per row
    big = cfg(cache=2, block=512, vec=4)  # 128 registers
    assert SPEC.defines(big, (64, 8192), "float32")["WB_REGS"] == 1  # 4 x 16 + 40 + 2 x 4
    assert SPEC.check(big, (64, 16384), "float32") is None  # s, its loads: 2 x 32 + 16 + 32
    assert SPEC.defines(big, (64, 16384), "float32")["WB_REGS"] == 0  # 4 x 32 + 40 + 16


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_valid_for_every_shape(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert SPEC.check(config, shape, dtype) is None
    assert SPEC.launch(config, shape, dtype).grid[0] >= 1


def test_default_config_choices_and_launch() -> None:
    hidden = SPEC.default_config((8192, 768), "bfloat16")
    assert (hidden["VEC"], hidden["ROW_THREADS"], hidden["CACHE"]) == (8, 32, 2)
    assert SPEC.default_config((7, 1000003), "float32")["CACHE"] == 0
    with pytest.raises(InvalidInput):
        SPEC.default_config((4, 4), "int32")
    a, b = cfg(block=128, row_threads=32), cfg(block=128, row_threads=32, group_rows=16)
    assert SPEC.render(a, (1000, 128), "float32") == SPEC.render(b, (1000, 128), "float32")
    assert SPEC.launch(b, (1000, 128), "float32") == Launch(
        grid=(math.ceil(1000 / 64), 1, 1), block=(128, 1, 1)
    )


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    problem = SPEC.make_problem((37, 300), dtype, np.random.default_rng(1))
    x, res, w, b, s, y, mean, rstd, rows, cols, eps = problem.args
    t = DTYPES[dtype][0]
    assert x.dtype == res.dtype == w.dtype == b.dtype == s.dtype == y.dtype == t
    assert mean.dtype == rstd.dtype == np.float32
    assert (rows, cols) == (37, 300) and eps == np.float32(EPS)
    assert problem.outputs == [4, 5, 6, 7]
    for out in (s, y, mean, rstd):
        assert np.isnan(out.astype(np.float64)).all()
    assert problem.tolerances == [
        SPEC.SUM_TOLERANCES[dtype],
        SPEC.tolerance(dtype),
        STATS_TOLERANCE,
        STATS_TOLERANCE,
    ]
    x64, r64 = x.astype(np.float64), res.astype(np.float64)
    s64 = x64 + r64
    assert np.all(np.abs(s64[0::4].mean(axis=1) - 1e3) < 5)  # far from zero against spread 8
    ratio = np.abs(s64).mean(axis=1) / np.abs(x64).mean(axis=1)
    assert np.all(ratio[2::4] < 0.1) and np.all(ratio[1::4] > 0.1)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_reference_equals_torch(dtype) -> None:
    """s rounds as torch's x + residual in the element type does; y, mean and rstd are torch's
    native_layer_norm of that s (in float64)."""
    torch = pytest.importorskip("torch")
    problem = SPEC.make_problem((6, 257), dtype, np.random.default_rng(4))
    x, res, w, b = problem.args[:4]
    s_ref, y_ref, mean_ref, rstd_ref = problem.references
    tdtype = getattr(torch, dtype)

    def t(a):
        return torch.tensor(a.astype(np.float32)).to(tdtype)

    s_torch = t(x) + t(res)
    stored = s_ref.astype(x.dtype).astype(np.float64)
    np.testing.assert_array_equal(s_torch.to(torch.float64).numpy(), stored)
    np.testing.assert_array_equal(s_ref, x.astype(np.float64) + res.astype(np.float64))
    f64 = torch.float64
    y_t, mean_t, rstd_t = torch.native_layer_norm(
        s_torch.to(f64), (257,), t(w).to(f64), t(b).to(f64), EPS
    )
    np.testing.assert_allclose(y_ref, y_t.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(mean_ref, mean_t.numpy().ravel(), rtol=1e-12)
    np.testing.assert_allclose(rstd_ref, rstd_t.numpy().ravel(), rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_rounded_references_are_within_tolerance(dtype) -> None:
    problem = SPEC.make_problem((16, 1000), dtype, np.random.default_rng(8))
    pairs = zip(problem.references[:2], problem.tolerances[:2], strict=True)
    for ref, (atol, rtol) in pairs:
        ideal = ref.astype(DTYPES[dtype][0]).astype(np.float64)
        np.testing.assert_allclose(ideal, ref, atol=atol, rtol=rtol)
        assert not np.allclose(ref * (1 + 4 * rtol), ref, atol=atol, rtol=rtol)
    # y normalised from x alone (the residual dropped) fails.
    x, _, w, b = problem.args[:4]
    atol, rtol = problem.tolerances[1]
    wrong = add_layernorm_reference(x, np.zeros_like(x), w, b, EPS)[1]
    assert not np.allclose(wrong, problem.references[1], atol=atol, rtol=rtol)


def test_bytes_moved_and_buffers() -> None:
    rows, cols = 8192, 768
    assert SPEC.bytes_moved((rows, cols), "bfloat16") == (
        4 * rows * cols * 2 + 2 * cols * 2 + 8 * rows
    )
    problem = SPEC.make_problem((3, 5), "float32", np.random.default_rng(0))
    assert problem.nbytes == SPEC.buffer_bytes((3, 5), "float32")
