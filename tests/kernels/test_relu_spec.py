"""The relu (forward + backward pair) spec: constraints, defaults, steps, problems, references,
and the kernels' mask logic (bit placement, OR butterfly, backward extraction) in numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, get_operator, list_operators
from kato.kernels.limits import NUM_SMS
from kato.kernels.relu import ReluSpec, mask_words, pack_mask
from kato.tuner.space import SearchSpace

SPEC = get_operator("relu")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
SIZES = [1, 2, 7, 31, 32, 33, 63, 64, 65, 1000, 4097, 1000003, 2**28, 2**31 + 3]


def cfg(mask=1, block=256, vec=4, unroll=2, bps=8):
    return {"MASK": mask, "BLOCK_SIZE": block, "VEC": vec, "UNROLL": unroll, "BLOCKS_PER_SM": bps}


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, ReluSpec)
    assert SPEC in list_operators()
    assert SPEC.rank == 1 and SPEC.dtypes == DTYPE_NAMES
    assert SPEC.kernel_names == ("relu_forward", "relu_backward")
    source = SPEC.template.read_text()
    assert "__ballot_sync" in source and "namespace KATO_NS" in source


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (1024,), "float32", "32-byte vector"),
        (cfg(block=1024, vec=4, unroll=8), (1024,), "float32", "would spill"),
        (cfg(block=1024, vec=8, unroll=8, mask=0), (1024,), "bfloat16", "would spill"),
        (cfg(mask=2), (1024,), "float32", "not one of"),
        (cfg(bps=3), (1024,), "float32", "not one of"),
        (cfg(), (1024,), "int32", "does not support dtype"),
        (cfg(), (0,), "float32", "at least 1"),
        (cfg(), (2**62 + 1,), "float32", "2**62"),
        (cfg(), (2, 2), "float32", "rank 1"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


def test_check_rejects_missing_and_unknown_parameters() -> None:
    partial = cfg()
    del partial["MASK"]
    assert "missing parameter MASK" in SPEC.check(partial, (64,), "float32")
    assert "unknown parameter" in SPEC.check({**cfg(), "X": 1}, (64,), "float32")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_every_n_admits_every_config_with_vectors_up_to_16_bytes(dtype) -> None:
    """...except 1024 threads with 8 vectors of 16 bytes in flight (register cap 64)."""
    vecs = [v for v in SPEC.params["VEC"] if v * DTYPES[dtype][2] <= 16]
    spilling = len(SPEC.params["MASK"]) * len(SPEC.params["BLOCKS_PER_SM"])  # B=1024, U=8, 16 B
    expected = SPEC.space_size() // len(SPEC.params["VEC"]) * len(vecs) - spilling
    for n in (1, 33, 2**28):
        space = SearchSpace(SPEC.params, lambda c, n=n: SPEC.check(c, (n,), dtype))
        assert len(space.valid_configs()) == expected


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("n", SIZES)
def test_default_config_is_valid(n, dtype) -> None:
    config = SPEC.default_config((n,), dtype)
    assert SPEC.check(config, (n,), dtype) is None
    assert config["MASK"] == 1 and config["VEC"] * DTYPES[dtype][2] == 16
    with pytest.raises(InvalidInput):
        SPEC.default_config((0,), dtype)


def test_source_does_not_depend_on_n_or_the_grid() -> None:
    assert SPEC.render(cfg(bps=0), (7,), "float16") == SPEC.render(cfg(bps=16), (2**28,), "float16")


@pytest.mark.parametrize("n", SIZES)
def test_grid(n) -> None:
    for config in (cfg(bps=0), cfg(bps=2), cfg(bps=16, block=1024, unroll=8, vec=1)):
        grid = SPEC.launch(config, (n,), "float32").grid[0]
        slots = math.ceil(n / config["VEC"])
        needed = math.ceil(slots / (config["BLOCK_SIZE"] * config["UNROLL"]))
        assert 1 <= grid <= 2**31 - 1
        if config["BLOCKS_PER_SM"] == 0:
            assert grid == max(1, needed)
        else:
            assert grid == max(1, min(needed, config["BLOCKS_PER_SM"] * NUM_SMS))


def test_steps_pass_what_each_variant_reads() -> None:
    kinds = ["x", "dy", "y", "mask", "dx", "n"]
    for mask, saved in ((1, "mask"), (0, "x")):
        fwd, bwd = SPEC.steps(cfg(mask=mask), (1000,), "float16")
        assert (fwd.kernel, bwd.kernel) == ("relu_forward", "relu_backward")
        assert [kinds[i] for i in fwd.args] == ["x", "y", "mask", "n"]
        assert [kinds[i] for i in bwd.args] == [saved, "dy", "dx", "n"]
        assert fwd.launch == bwd.launch


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    n = 1001
    p = SPEC.make_problem((n,), dtype, np.random.default_rng(3))
    x, dy, y, mask, dx, n_arg = p.args
    for a in (x, dy, y, dx):
        assert a.dtype == DTYPES[dtype][0] and a.shape == (n,)
    assert not (x == 0).any() and not (dy == 0).any()
    assert 0.4 < (x.astype(np.float32) > 0).mean() < 0.6
    assert np.isnan(y.astype(np.float32)).all() and np.isnan(dx.astype(np.float32)).all()
    assert (
        mask.dtype == np.uint32 and mask.size == mask_words(n) == 32 and (mask == 0xFFFFFFFF).all()
    )
    assert n_arg == n and isinstance(n_arg, np.int64)
    assert p.outputs == [2, 4]
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    np.testing.assert_array_equal(p.references[0], np.maximum(x64, 0.0))
    np.testing.assert_array_equal(p.references[1], dy64 * (x64 > 0))
    assert SPEC.tolerance(dtype) == (0.0, 0.0)


def test_bytes_moved_is_the_bitmask_minimum() -> None:
    n = 2**28
    assert SPEC.bytes_moved((n,), "float32") == 4 * 4 * n + 2 * n // 8
    assert SPEC.bytes_moved((n,), "float16") == 4 * 2 * n + 2 * n // 8
    assert SPEC.bytes_moved((33,), "float32") == 4 * 4 * 33 + 2 * 2 * 4


# --- the mask layout and the kernels' mask logic ------------------------------------------------


def test_pack_mask_bit_order() -> None:
    positive = np.zeros(70, dtype=bool)
    positive[[0, 5, 31, 32, 63, 69]] = True
    words = pack_mask(positive)
    assert words.dtype == np.uint32 and words.size == 3
    assert words[0] == (1 << 0) | (1 << 5) | (1 << 31)
    assert words[1] == (1 << 0) | (1 << 31)
    assert words[2] == 1 << 5
    rng = np.random.default_rng(0)
    for n in (1, 31, 32, 33, 1000):
        p = rng.random(n) < 0.5
        w = pack_mask(p)
        unpacked = ((w[:, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(-1)[:n]
        np.testing.assert_array_equal(unpacked.astype(bool), p)


def forward_mask_model(positive: np.ndarray, vec: int, block: int, unroll: int, grid: int):
    """relu_forward's mask words, lane by lane: slot bits shifted to (lane % G) * VEC, OR
    butterfly over G = 32 / VEC lanes (__ballot_sync for VEC 1), the group's first lane stores
    word slot / G if its slot exists. Every word written at most once is asserted."""
    n = positive.size
    nslots = -(-n // vec)
    g_lanes = 32 // vec
    padded = np.zeros(nslots * vec + 32 * vec * unroll * grid * block, dtype=bool)
    padded[:n] = positive
    words = np.full(mask_words(n), 0xDEADBEEF, dtype=np.uint64)
    written = np.zeros(mask_words(n), dtype=int)
    threads = grid * block
    lanes = np.arange(32)
    for warp_first in range(0, threads, 32):
        for first in range(warp_first, nslots, threads * unroll):  # warp-uniform bound
            for u in range(unroll):
                slots = first + u * threads + lanes
                has = slots < nslots
                elems = padded[(slots[:, None] * vec + np.arange(vec)).clip(0, padded.size - 1)]
                bits = np.where(has, (elems * (1 << np.arange(vec))).sum(axis=1), 0)
                if vec == 1:
                    word = np.full(32, int((bits << lanes).sum()))
                else:
                    word = bits << ((lanes % g_lanes) * vec)
                    offset = g_lanes // 2
                    while offset:
                        word = word | word[lanes ^ offset]
                        offset //= 2
                for lane in lanes[has & (lanes % g_lanes == 0)]:
                    words[slots[lane] // g_lanes] = word[lane]
                    written[slots[lane] // g_lanes] += 1
    assert (written == 1).all()
    return words.astype(np.uint32)


@pytest.mark.parametrize("vec", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 100, 257, 1000, 4099])
def test_forward_mask_assembly_matches_pack_mask(n, vec) -> None:
    positive = np.random.default_rng(n * vec).random(n) < 0.5
    for block, unroll, grid in ((32, 1, 1), (64, 2, 1), (32, 4, 3)):
        got = forward_mask_model(positive, vec, block, unroll, grid)
        np.testing.assert_array_equal(got, pack_mask(positive))


@pytest.mark.parametrize("vec", [1, 2, 4, 8])
def test_backward_extraction_inverts_the_packing(vec) -> None:
    """relu_backward: bits of slot s = (word[s / G] >> ((s % G) * VEC)) & (2**VEC - 1)."""
    n = 1003
    positive = np.random.default_rng(vec).random(n) < 0.5
    words = pack_mask(positive).astype(np.uint64)
    g_lanes = 32 // vec
    for s in range(-(-n // vec)):
        bits = (int(words[s // g_lanes]) >> ((s % g_lanes) * vec)) & ((1 << vec) - 1)
        for j in range(vec):
            if s * vec + j < n:
                assert bool(bits >> j & 1) == positive[s * vec + j]
            else:
                assert not bits >> j & 1  # bits past n are 0
