"""The sort and sort_1d specs: constraints, defaults, launch sequences, problems, references,
and the kernels' algorithm replayed in numpy with the kernels' own index formulas (key order
mapping, the mirror form of bitonic sort with virtual padding, the grouping of fused global
passes, the whole step sequence of sort_1d)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kato.kernels import InvalidInput, get_operator, list_operators
from kato.kernels.sort import (
    GLOBAL_BLOCK,
    MAX_ROW,
    RADIX_DEFAULT_MIN,
    Sort1dSpec,
    SortSpec,
    capacity,
    make_keys,
    next_pow2,
    radix,
    register_cap,
    shared_bytes,
    sort_reference,
)
from kato.tuner.space import SearchSpace

SORT = get_operator("sort")
SORT_1D = get_operator("sort_1d")
KEYS = ("float32", "int32")
ROW_SHAPES = [(1, 1), (1, 2), (3, 3), (1000, 1), (17, 33), (4096, 4096), (5, 4097), (2, 8192)]
ROW_SHAPES += [(65536, 128), (3, 6000), (100000, 7)]
N_SHAPES = [(1,), (2,), (3,), (4096,), (8191,), (8193,), (3001,), (2**24,), (10**7 + 3,)]
MAX_KEY = 0xFFFFFFFF


def rows_cfg(block=256, items=8, shfl=1, smem_fuse=2):
    config = {"BLOCK": block, "ITEMS": items, "WARP_SHFL": shfl, "SMEM_FUSE": smem_fuse}
    return {**config, "ALGO": "bitonic", "RADIX_BITS": 4, "RANK": "match", "HIST": "scalar"}


def cfg_1d(block=1024, items=8, shfl=1, fuse=3, smem_fuse=2):
    config = {**rows_cfg(block, items, shfl, smem_fuse), "FUSE": fuse}
    return {**config, "ALGO": "bitonic", "RADIX_BITS": 4, "RANK": "match", "HIST": "scalar"}


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SORT, SortSpec) and isinstance(SORT_1D, Sort1dSpec)
    assert SORT in list_operators() and SORT_1D in list_operators()
    assert SORT.dtypes == KEYS and SORT_1D.dtypes == KEYS
    assert SORT.rank == 2 and SORT_1D.rank == 1
    assert SORT.kernel_names == ("sort_rows_kernel", *radix.KERNELS)
    assert SORT_1D.kernel_name == SORT_1D.kernel_names[0] == "sort_1d_block"
    source = SORT.template.read_text()
    bitonic = [n for n in SORT_1D.kernel_names if n.startswith("sort_1d_")]
    assert len(bitonic) == 5
    for name in (SORT.kernel_name, *bitonic):
        assert (
            f"void KATO_LAUNCH_BOUNDS {name}(" in source
            or f"void __launch_bounds__(256) {name}(" in source
        )


def test_validate() -> None:
    # Rows longer than MAX_ROW (radix) up to the radix sort's 2**30 - 1 keys, 2**40 in all.
    assert SORT.validate((2, MAX_ROW + 1), "float32") == (2, MAX_ROW + 1)
    assert SORT.validate((2, MAX_ROW), "int32") == (2, MAX_ROW)
    assert SORT.validate((1024, 2**30 - 1), "int32") == (1024, 2**30 - 1)
    with pytest.raises(InvalidInput, match="2\\*\\*30 - 1"):
        SORT.validate((1, 2**30), "float32")
    with pytest.raises(InvalidInput, match="2\\*\\*40"):
        SORT.validate((1025, 2**30 - 1), "float32")
    assert SORT.validate((2**31 - 1, MAX_ROW), "int32") == (2**31 - 1, MAX_ROW)
    with pytest.raises(InvalidInput, match="dtype"):
        SORT.validate((2, 2), "float16")
    with pytest.raises(InvalidInput, match="rank"):
        SORT_1D.validate((2, 2), "float32")
    with pytest.raises(InvalidInput, match="2\\*\\*40"):
        SORT_1D.validate((2**40 + 1,), "float32")


@pytest.mark.parametrize("dtype", KEYS)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_row_default_is_valid(shape, dtype) -> None:
    config = SORT.default_config(shape, dtype)
    assert SORT.check(config, shape, dtype) is None
    launch = SORT.launch(config, shape, dtype)
    per_block = capacity(config) // next_pow2(shape[1])
    assert launch.grid[0] == min(math.ceil(shape[0] / per_block), 1 << 20)
    assert launch.shared_bytes == shared_bytes(config) <= 227 * 1024


@pytest.mark.parametrize("dtype", KEYS)
@pytest.mark.parametrize("shape", N_SHAPES, ids=lambda s: str(s[0]))
def test_1d_default_is_valid(shape, dtype) -> None:
    config = SORT_1D.default_config(shape, dtype)
    assert SORT_1D.check(config, shape, dtype) is None
    steps = SORT_1D.steps(config, shape, dtype)
    # radix from RADIX_DEFAULT_MIN keys (measured faster there), bitonic below
    radix_default = shape[0] >= RADIX_DEFAULT_MIN
    assert config["ALGO"] == ("radix" if radix_default else "bitonic")
    assert steps[0].kernel == ("radix_init" if radix_default else "sort_1d_block")
    for step in steps:
        assert step.launch.threads_per_block <= 1024
        assert 1 <= step.launch.grid[0] <= 2**31 - 1


def test_check_rejects_what_cannot_work() -> None:
    assert SORT.check(rows_cfg(512, 8), (10, 4096), "float32") is None
    assert "next_pow2" in SORT.check(rows_cfg(256, 8), (10, 4096), "float32")
    assert "next_pow2" in SORT.check(rows_cfg(256, 8), (10, 2049), "float32")
    assert SORT.check(rows_cfg(256, 8), (10, 2048), "float32") is None
    assert "ALGO=bitonic takes ITEMS" in SORT.check(rows_cfg(1024, 16), (1, 8), "float32")
    assert "not one of" in SORT.check(rows_cfg(1024, 32), (1, 8), "float32")
    assert "not one of" in SORT.check(rows_cfg(smem_fuse=3), (1, 8), "float32")
    # The register model: 8 keys + overhead fit what 1024 threads leave (64 registers).
    assert register_cap(rows_cfg(1024, 8)) == 64
    assert SORT.check(rows_cfg(1024, 8), (1, 8), "float32") is None
    assert "missing" in SORT.check({"BLOCK": 64}, (1, 8), "float32")
    assert "unknown" in SORT_1D.check({**cfg_1d(), "X": 1}, (8,), "float32")
    assert "not one of" in SORT_1D.check(cfg_1d(fuse=4), (8,), "float32")


def test_space_sizes() -> None:
    for dtype in KEYS:
        rows = SearchSpace(SORT.params, lambda c, d=dtype: SORT.check(c, (4096, 4096), d))
        short = SearchSpace(SORT.params, lambda c, d=dtype: SORT.check(c, (1000, 1), d))
        flat = SearchSpace(SORT_1D.params, lambda c, d=dtype: SORT_1D.check(c, (2**24,), d))
        assert len(rows.valid_configs()) >= 12  # C >= 4096: 512 x 8, 1024 x 4, 1024 x 8
        assert 60 <= len(short.valid_configs()) <= 150  # every source of the row kernel
        bitonic = [c for c in flat.valid_configs() if c["ALGO"] == "bitonic"]
        assert len(bitonic) >= 100
        sources = {SORT_1D.render(c, (2**24,), dtype) for c in bitonic}
        assert len(sources) <= len(bitonic) // 3  # FUSE does not change the source
    # Key types share sources (the key type is a kernel argument).
    config = rows_cfg()
    assert SORT.render(config, (4, 4), "float32") == SORT.render(config, (4, 4), "int32")


@pytest.mark.parametrize("dtype", KEYS)
def test_keys_stress_the_sort(dtype) -> None:
    keys = make_keys(20000, dtype, np.random.default_rng(1))
    assert keys.dtype == np.dtype(dtype)
    values, counts = np.unique(keys, return_counts=True)
    assert counts.max() > 100  # heavy duplicates
    assert (keys != 0).any()
    if dtype == "float32":
        assert not np.isnan(keys).any()
        assert np.isposinf(keys).any() and np.isneginf(keys).any()
        assert (np.signbit(keys) & (keys == 0)).any() and (~np.signbit(keys) & (keys == 0)).any()
        assert np.abs(keys[np.isfinite(keys)]).max() > 1e6
    else:
        assert keys.min() == -(2**31) and keys.max() == 2**31 - 1


@pytest.mark.parametrize("spec,shape", [(SORT, (9, 70)), (SORT_1D, (1001,))])
@pytest.mark.parametrize("dtype", KEYS)
def test_problem_and_reference(spec, shape, dtype) -> None:
    problem = spec.make_problem(shape, dtype, np.random.default_rng(2))
    x, y = problem.args[0], problem.args[1]
    assert x.shape == shape == y.shape and x.dtype == y.dtype == np.dtype(dtype)
    assert problem.outputs == [1]
    if dtype == "float32":
        assert np.isnan(y).all()
    else:
        assert (y == -12345).all()
    ref = problem.references[0]
    assert ref.dtype == (np.float64 if dtype == "float32" else np.int64)
    np.testing.assert_array_equal(ref, np.sort(x.astype(ref.dtype), axis=-1))
    assert (ref[..., 1:] >= ref[..., :-1]).all()
    assert spec.tolerance(dtype) == (0.0, 0.0)
    if spec is SORT:
        assert problem.args[2:] == [9, 70, int(dtype == "float32")]
        assert all(isinstance(a, np.int32) for a in problem.args[2:])
    if spec is SORT_1D:
        assert isinstance(problem.args[2], np.int64) and problem.args[2] == shape[0]
        assert all(
            problem.args[3 + v] == v and isinstance(problem.args[3 + v], np.int32)
            for v in range(64)
        )


def test_reference_sorts_each_row() -> None:
    x = np.array([[3, 1, 2], [0, -5, 9]], np.int32)
    np.testing.assert_array_equal(sort_reference(x), [[1, 2, 3], [-5, 0, 9]])


# --- the algorithm in numpy, with the kernels' formulas -----------------------------------------


def to_ord(keys: np.ndarray) -> np.ndarray:
    bits = keys.view(np.uint32).astype(np.uint32)
    if keys.dtype == np.float32:
        flip = (bits.view(np.int32) >> 31).view(np.uint32) | np.uint32(0x80000000)
        return bits ^ flip
    return bits ^ np.uint32(0x80000000)


def from_ord(ords: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        mask = ((ords >> np.uint32(31)) - np.uint32(1)) | np.uint32(0x80000000)
        return (ords ^ mask).view(np.float32)
    return (ords ^ np.uint32(0x80000000)).view(np.int32)


@pytest.mark.parametrize("dtype", KEYS)
def test_key_order_mapping(dtype) -> None:
    keys = make_keys(5000, dtype, np.random.default_rng(3))
    ords = to_ord(keys)
    np.testing.assert_array_equal(from_ord(ords, dtype).view(np.uint32), keys.view(np.uint32))
    order = np.argsort(ords, kind="stable")
    ordered = keys[order].astype(np.float64)
    assert (ordered[1:] >= ordered[:-1]).all()
    if dtype == "float32":
        special = to_ord(np.array([-np.inf, -1.0, -0.0, 0.0, 1.0, np.inf], np.float32))
        assert (np.diff(special.astype(np.int64)) > 0).all()
        assert special[-1] < MAX_KEY  # padding sorts after +inf


def merge_step(buf: np.ndarray, k: int, j: int, mirror: bool) -> None:
    """One shared-memory stage of ``merge`` over a whole block buffer: pair p -> (lo, hi)."""
    p = np.arange(buf.shape[-1] // 2)
    lo = ((p & ~(j - 1)) << 1) | (p & (j - 1))
    hi = lo ^ (2 * j - 1) if mirror else lo + j
    a, b = buf[..., lo], buf[..., hi]
    buf[..., lo], buf[..., hi] = np.minimum(a, b), np.maximum(a, b)


def block_sort(ords: np.ndarray, seg: int, log2n: int, c: int, full: bool) -> np.ndarray:
    """sort_segments: segments of `seg` keys padded to 2^log2n, C / 2^log2n per block."""
    n = ords.size
    npad = 1 << log2n
    nsegs = math.ceil(n / seg)
    buf = np.full((nsegs, npad), MAX_KEY, np.uint32)
    for r in range(nsegs):
        part = ords[r * seg : min((r + 1) * seg, n)]
        buf[r, : part.size] = part
    per_block = c // npad
    groups = math.ceil(nsegs / per_block)
    buf = np.concatenate([buf, np.full((groups * per_block - nsegs, npad), MAX_KEY, np.uint32)])
    blocks = buf.reshape(groups, c)
    ks = [1 << e for e in range(1, log2n + 1)] if full else [npad]
    for k in ks:
        j = k // 2
        while j >= 1:
            merge_step(blocks, k, j, full and 2 * j == k)
            j //= 2
    out = ords.copy()
    flat = blocks.reshape(-1, npad)
    for r in range(nsegs):
        size = min((r + 1) * seg, n) - r * seg
        out[r * seg : r * seg + size] = flat[r, :size]
    return out


def global_pass(ords: np.ndarray, hi: int, f: int, flip: int) -> None:
    """global_pass<F> with the kernel's group formulas (vectorised over groups)."""
    n = ords.size
    g_size, half = 1 << f, 1 << (f - 1)
    lo = hi - f + 1
    ngroups = math.ceil(n / 2 ** (hi + 1)) << (hi + 1 - f)
    p = np.arange(ngroups, dtype=np.int64)
    i = ((p >> lo) << (hi + 1)) | (p & ((1 << lo) - 1))
    if flip:
        ub = (i ^ ((1 << (hi + 1)) - 1)) - ((half - 1) << lo)
        idx = [i + (a << lo) for a in range(half)] + [ub + (a << lo) for a in range(half)]
    else:
        idx = [i + (a << lo) for a in range(g_size)]
    idx = np.stack(idx)
    # The groups partition the covered range: every key is read and written by one thread.
    assert np.array_equal(np.sort(idx.ravel()), np.arange(ngroups * g_size))
    g = np.where(idx < n, ords[np.minimum(idx, n - 1)], MAX_KEY).astype(np.uint32)

    def cas(a: int, b: int) -> None:
        g[a], g[b] = np.minimum(g[a], g[b]), np.maximum(g[a], g[b])

    if flip:
        for a in range(half):
            cas(a, g_size - 1 - a)
    else:
        for a in range(g_size):
            if not a & half:
                cas(a, a | half)
    b = half // 2
    while b >= 1:
        for a in range(g_size):
            if not a & b:
                cas(a, a | b)
        b //= 2
    keep = idx < n
    ords[idx[keep]] = g[keep]


def run_1d_steps(config, n: int, keys: np.ndarray) -> np.ndarray:
    problem_scalars = [np.int64(n), *(np.int32(v) for v in range(64))]
    arg = lambda k: problem_scalars[k - 2]  # noqa: E731 - args[2:] of the problem
    c = capacity(config)
    ords = to_ord(keys)
    for step in SORT_1D.steps(config, (n,), "float32"):
        if step.kernel == "sort_1d_block":
            log2seg = int(arg(step.args[3]))
            ords = block_sort(ords, 1 << log2seg, log2seg, c, full=True)
        elif step.kernel == "sort_1d_merge":
            ords = block_sort(ords, c, c.bit_length() - 1, c, full=False)
        else:
            f = int(step.kernel[-1])
            assert step.launch.block == (GLOBAL_BLOCK, 1, 1)
            global_pass(ords, int(arg(step.args[2])), f, int(arg(step.args[3])))
    return ords


@pytest.mark.parametrize("fuse", (1, 2, 3))
@pytest.mark.parametrize("n", (1, 5, 64, 65, 1000, 4096, 4097, 12345))
def test_1d_step_sequence_sorts_in_numpy(n, fuse) -> None:
    config = cfg_1d(block=128, items=4, fuse=fuse)  # C = 512: several global merges
    for dtype in KEYS:
        keys = make_keys(n, dtype, np.random.default_rng(n))
        ords = run_1d_steps(config, n, keys)
        np.testing.assert_array_equal(from_ord(ords, dtype), np.sort(keys))


def test_1d_launch_sequence_counts() -> None:
    """2^24 keys, C = 8192: 11 merges of 1..11 global strides, in ceil(s / FUSE) passes."""
    n = 2**24
    for fuse in (1, 2, 3):
        steps = SORT_1D.steps(cfg_1d(fuse=fuse), (n,), "float32")
        merges = [s for s in steps if s.kernel == "sort_1d_merge"]
        passes = [s for s in steps if s.kernel.startswith("sort_1d_global")]
        assert len(merges) == 11
        assert len(passes) == sum(math.ceil(s / fuse) for s in range(1, 12))
        flips = [s for s in passes if s.args[3] == 4]  # index of the int32 scalar 1
        assert len(flips) == 11
    assert len(SORT_1D.steps(cfg_1d(), (8192,), "int32")) == 1
    assert SORT_1D.steps(cfg_1d(), (5,), "int32")[0].args == (0, 1, 2, 3 + 3, 3 + 0)
    assert all(s.args[-1] == 3 + 1 for s in SORT_1D.steps(cfg_1d(), (10**5,), "float32"))


@pytest.mark.parametrize("cols", (1, 2, 3, 31, 64, 100))
def test_row_sort_in_numpy(cols) -> None:
    for dtype in KEYS:
        x = make_keys(7 * cols, dtype, np.random.default_rng(cols)).reshape(7, cols)
        log2n = max(0, (cols - 1).bit_length())
        out = block_sort(to_ord(x.ravel()), cols, log2n, 256, full=True)
        np.testing.assert_array_equal(from_ord(out, dtype).reshape(7, cols), np.sort(x, axis=1))


@pytest.mark.parametrize("mirror", (False, True))
def test_fused_shared_stage_groups(mirror) -> None:
    """quad_step's groups (SMEM_FUSE=2) partition the block buffer, and running its exchanges
    equals the two single-stride stages it replaces."""
    c = 1024
    rng = np.random.default_rng(5)
    for hi in range(1, 10):
        j = 1 << hi
        k = 2 * j
        p = np.arange(c // 4)
        lo = hi - 1
        i = ((p >> lo) << (hi + 1)) | (p & ((1 << lo) - 1))
        up = (i ^ ((1 << (hi + 1)) - 1)) - (1 << lo) if mirror else i + (1 << hi)
        idx = np.stack([i, i + (1 << lo), up, up + (1 << lo)])
        assert np.array_equal(np.sort(idx.ravel()), np.arange(c))
        buf = rng.integers(0, 50, c).astype(np.uint32)
        expect = buf.copy()
        merge_step(expect, k, j, mirror)
        merge_step(expect, k, j // 2, False)
        g = buf[idx]
        pairs = [(0, 3), (1, 2)] if mirror else [(0, 2), (1, 3)]
        for a, b in [*pairs, (0, 1), (2, 3)]:
            g[a], g[b] = np.minimum(g[a], g[b]), np.maximum(g[a], g[b])
        buf[idx] = g
        np.testing.assert_array_equal(buf, expect)
