"""The reduce_sum_all spec: constraints, defaults, rendering, steps, problems, and the exact float32
model of the kernel's summation tree (accuracy on 2**26 elements vs a serial float32 sum)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, get_operator, list_operators
from kato.kernels.limits import NUM_SMS
from kato.kernels.reduce_sum_all import (
    EPS32,
    ReduceSumAllSpec,
    block_sum_model,
    butterfly,
    sentinel_magnitude,
    step_sum,
    sum_tolerance,
    summation_model,
)
from kato.tuner.space import SearchSpace

SPEC = get_operator("reduce_sum_all")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
SIZES = [1, 2, 3, 7, 31, 32, 33, 1000, 4097, 65537, 1000003, 2**20, 2**26, 2**28, 2**31 + 5]


def cfg(block=256, vec=4, unroll=4, bps=4, finish=0):
    return {
        "BLOCK_SIZE": block,
        "VEC": vec,
        "UNROLL": unroll,
        "BLOCKS_PER_SM": bps,
        "FINISH": finish,
    }


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, ReduceSumAllSpec)
    assert SPEC in list_operators()
    assert SPEC.rank == 1 and SPEC.shape_names == ("n",)
    assert SPEC.dtypes == DTYPE_NAMES
    assert SPEC.kernel_name == "reduce_sum_all_kernel"
    source = SPEC.template.read_text()
    for name in SPEC.kernel_names:
        assert 'extern "C" __global__ void' in source and f"{name}(" in source
    assert "namespace KATO_NS" in source and "#pragma once" not in source


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (1024,), "float32", "32-byte vector"),
        (cfg(block=48), (1024,), "float32", "not one of"),
        (cfg(finish=3), (1024,), "float32", "not one of"),
        (cfg(), (1024,), "int32", "does not support dtype"),
        (cfg(), (0,), "float32", "at least 1"),
        (cfg(), (2**62 + 1,), "float32", "2**62"),
        (cfg(), (4, 4), "float32", "rank 1"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


def test_check_rejects_missing_and_unknown_parameters() -> None:
    partial = cfg()
    del partial["VEC"]
    assert "missing parameter VEC" in SPEC.check(partial, (64,), "float32")
    assert "unknown parameter" in SPEC.check({**cfg(), "TILE": 1}, (64,), "float32")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_valid_space_is_everything_but_oversized_vectors(dtype) -> None:
    """Tails are handled in the kernel: every n admits every config with vectors <= 16 bytes."""
    vecs = [v for v in SPEC.params["VEC"] if v * DTYPES[dtype][2] <= 16]
    expected = SPEC.space_size() // len(SPEC.params["VEC"]) * len(vecs)
    for n in (1, 7, 2**28):
        valid = SearchSpace(SPEC.params, lambda c, n=n: SPEC.check(c, (n,), dtype)).valid_configs()
        assert len(valid) == expected


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("n", SIZES)
def test_default_config_is_valid(n, dtype) -> None:
    config = SPEC.default_config((n,), dtype)
    assert SPEC.check(config, (n,), dtype) is None
    assert config["VEC"] * DTYPES[dtype][2] == 16


def test_default_rejects_invalid_shapes() -> None:
    with pytest.raises(InvalidInput):
        SPEC.default_config((0,), "float32")


def test_source_does_not_depend_on_n_or_the_grid() -> None:
    a = SPEC.render(cfg(bps=1), (7,), "float16")
    b = SPEC.render(cfg(bps=32), (2**28,), "float16")
    assert a == b
    assert (
        "#define DTYPE __half" in a
        and "#define IS_HALF 1" in a
        and "#define BLOCKS_PER_SM" not in a
    )


@pytest.mark.parametrize("n", SIZES)
def test_grid_is_bounded_and_never_empty(n) -> None:
    for config in (cfg(bps=1), cfg(bps=32, block=128, unroll=2, vec=2), cfg(block=1024)):
        launch = SPEC.launch(config, (n,), "float32")
        assert 1 <= launch.grid[0] <= config["BLOCKS_PER_SM"] * NUM_SMS <= SPEC.MAX_GRID
        assert launch.block == (config["BLOCK_SIZE"], 1, 1)
        # No block without work (except the single block of a tiny n)
        slots = math.ceil(n / config["VEC"])
        assert (launch.grid[0] - 1) * config["BLOCK_SIZE"] * config["UNROLL"] < max(slots, 1)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("n", [2**20 + 1, 1000003 * 3, 2**24 + 1, 67108863, 2**28 + 7])
def test_default_fills_every_sm_at_any_length_past_a_million(n, dtype) -> None:
    """Issue 31: the untuned default of an awkward length (prime, odd, just past a power of
    two) launches a block on every SM of the largest GPU, with 16-byte vectors (the n % VEC
    tail is the first threads' scalar work, not a narrower vector)."""
    config = SPEC.default_config((n,), dtype)
    assert config["VEC"] * DTYPES[dtype][2] == 16
    assert SPEC.launch(config, (n,), dtype).grid[0] >= NUM_SMS


def test_steps_per_finish() -> None:
    shape = (1000003,)
    problem = SPEC.make_problem((64,), "float32", np.random.default_rng(0))
    kinds = ["x", "out", "partials", "counter", "n"]
    assert [type(a) for a in problem.args][-1] is np.int64
    two = SPEC.steps(cfg(finish=0), shape, "float32")
    assert [s.kernel for s in two] == ["reduce_sum_all_kernel", "reduce_sum_all_finish"]
    assert [kinds[i] for i in two[0].args] == kinds
    assert [kinds[i] for i in two[1].args] == ["partials", "out", "counter"]
    assert two[1].launch.grid == (1, 1, 1) and two[1].launch.block == (256, 1, 1)
    atomic = SPEC.steps(cfg(finish=1), shape, "float32")
    assert [s.kernel for s in atomic] == ["reduce_sum_all_init", "reduce_sum_all_kernel"]
    assert [kinds[i] for i in atomic[0].args] == ["out"]
    last = SPEC.steps(cfg(finish=2), shape, "float32")
    assert [s.kernel for s in last] == ["reduce_sum_all_kernel"]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    n = 10007
    p = SPEC.make_problem((n,), dtype, np.random.default_rng(1))
    x, out, partials, counter, n_arg = p.args
    assert x.dtype == DTYPES[dtype][0] and x.shape == (n,)
    assert not (x == 0).any()
    assert 0.15 < (x.astype(np.float64) < 0).mean() < 0.35  # a quarter negated
    assert np.isnan(out).all() and out.dtype == np.float32 and out.shape == (1,)
    assert partials.size == SPEC.MAX_GRID and np.isnan(partials).all()
    assert counter.dtype == np.uint32 and (counter == 0).all() and counter.size == 2
    assert n_arg == n and p.outputs == [1]
    exact = math.fsum(float(v) for v in x.astype(np.float64))
    assert p.references[0][0] == pytest.approx(exact, rel=1e-12)
    ((atol, rtol),) = p.tolerances
    assert atol == pytest.approx(sum_tolerance(float(np.abs(x.astype(np.float64)).sum())))
    assert rtol == 0.0
    again = SPEC.make_problem((n,), dtype, np.random.default_rng(2))
    assert not np.array_equal(again.args[0], x)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("n", [1, 33, 10007, 2**20 + 3])
def test_a_sum_that_skips_the_head_or_the_tail_fails(n, dtype) -> None:
    """Without sentinels the tolerance (~1000 at 2**26) hid a dropped remainder of up to
    hundreds of elements; now dropping the first or the last element (a vector head or tail
    missed) is off by more than the tolerance, however large n is."""
    p = SPEC.make_problem((n,), dtype, np.random.default_rng(4))
    x = p.args[0].astype(np.float64)
    ((atol, _),) = p.tolerances
    exact = float(p.references[0][0])
    assert abs(x.sum() - exact) <= atol  # the full sum passes
    for skipped in (x[1:], x[:-1]):
        assert abs(skipped.sum() - exact) > 4 * atol
    assert sentinel_magnitude(2**26, dtype) >= 8 * sum_tolerance(1.5 * 2**26)


def test_bytes_moved() -> None:
    assert SPEC.bytes_moved((2**28,), "float32") == 2**30
    assert SPEC.bytes_moved((2**28,), "float16") == 2**29
    assert SPEC.buffer_bytes((10,), "float32") > 40


# --- the summation model ------------------------------------------------------------------


def test_step_sum_is_pairwise_per_vector_then_across() -> None:
    f = np.arange(1, 33, dtype=np.float32).reshape(1, 4, 8)  # UNROLL 4, VEC 8
    per_vector = [((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])) for a in f[0]]
    expected = (per_vector[0] + per_vector[2]) + (per_vector[1] + per_vector[3])
    assert step_sum(f)[0] == expected


def test_butterfly_gives_every_lane_the_group_sum() -> None:
    v = np.random.default_rng(0).uniform(size=(3, 32)).astype(np.float32)
    for width in (8, 16, 32):
        out = butterfly(v, width)
        groups = v.reshape(3, 32 // width, width).astype(np.float64).sum(-1)
        np.testing.assert_allclose(out.reshape(3, 32 // width, width)[..., 0], groups, rtol=1e-6)
        # all lanes of a group agree bit for bit (float + is commutative)
        assert (out.reshape(3, -1, width) == out.reshape(3, -1, width)[..., :1]).all()


def test_block_sum_model_pads_warps_with_zeros() -> None:
    v = np.ones((2, 256), dtype=np.float32)
    assert (block_sum_model(v) == 256).all()


@pytest.mark.parametrize("n", [1, 2, 3, 9, 100, 4097, 65539])
@pytest.mark.parametrize(
    "config",
    [cfg(), cfg(block=128, vec=2, unroll=8, bps=1), cfg(block=1024, vec=8, unroll=2, bps=32)],
    ids=str,
)
def test_model_matches_float64_on_small_and_odd_sizes(n, config) -> None:
    """Tails (n % VEC), partial steps and idle threads of the model are summed correctly."""
    x = np.random.default_rng(n).uniform(0.5, 1.5, size=n).astype(np.float32)
    got = summation_model(x, config, SPEC.grid(config, (n,)))
    exact = math.fsum(x.astype(np.float64))
    assert abs(float(got) - exact) <= 4 * EPS32 * exact


def test_model_beats_naive_float32_on_2_pow_26_elements() -> None:
    """The kernel's tree (modelled bit for bit) vs float64, against np.cumsum in float32."""
    n = 2**26
    x = np.random.default_rng(26).uniform(0.5, 1.5, size=n).astype(np.float32)
    exact = x.astype(np.float64).sum()
    naive = abs(float(np.cumsum(x, dtype=np.float32)[-1]) - exact)
    for config in (SPEC.default_config((n,), "float32"), cfg(block=1024, vec=2, unroll=8, bps=1)):
        got = summation_model(x, config, SPEC.grid(config, (n,)))
        error = abs(float(got) - exact)
        assert error < naive / 1000, (config, error, naive)
        assert error <= sum_tolerance(exact) / 16  # well inside the verification tolerance
