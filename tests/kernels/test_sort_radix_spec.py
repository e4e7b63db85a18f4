"""The radix sort path of sort_1d (ALGO=radix) and sort_1d_pairs: the space is honest (no two
valid configs run the same code), the checks, the launch sequence (buffers, ping-pong, scalar
arguments), the problems' scratch and the stable-order reference. The kernels' logic runs on
the CPU in test_sort_radix_emulation.py and compiles in test_sort_compile.py."""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pytest
from kato.kernels import InvalidInput, get_operator, list_operators
from kato.kernels.sort import KEYS_LAYOUT, PAIRS_LAYOUT, radix
from kato.tuner.space import SearchSpace

SORT_1D = get_operator("sort_1d")
PAIRS = get_operator("sort_1d_pairs")
KEYS = ("float32", "int32")


def radix_cfg(block=512, items=16, bits=8, rank="match", hist="scalar"):
    return {
        "BLOCK": block,
        "ITEMS": items,
        "WARP_SHFL": 0,
        "SMEM_FUSE": 1,
        "FUSE": 1,
        "ALGO": "radix",
        "RADIX_BITS": bits,
        "RANK": rank,
        "HIST": hist,
    }


def pairs_cfg(block=512, items=12, bits=8, rank="match", hist="scalar"):
    return {"BLOCK": block, "ITEMS": items, "RADIX_BITS": bits, "RANK": rank, "HIST": hist}


def valid(spec, n=2**24, dtype="float32"):
    return SearchSpace(spec.params, lambda c: spec.check(c, (n,), dtype)).valid_configs()


def test_registered_and_versioned_by_both_templates() -> None:
    assert PAIRS in list_operators() and PAIRS.dtypes == KEYS and PAIRS.rank == 1
    assert SORT_1D.extra_templates == (radix.TEMPLATE,)
    assert PAIRS.template == radix.TEMPLATE and PAIRS.kernel_names == radix.KERNELS
    source = radix.TEMPLATE.read_text()
    for name in radix.KERNELS:
        assert f"{name}(" in source and name in SORT_1D.kernel_names
    assert SORT_1D.main_kernel(radix_cfg()) == PAIRS.main_kernel(pairs_cfg()) == "radix_pass"
    assert SORT_1D.main_kernel(SORT_1D.default_config((10,), "int32")) == "sort_1d_block"


def test_the_space_has_no_duplicate_configs() -> None:
    """Every valid config of either algorithm renders or launches differently from every other:
    the tunables an algorithm ignores are fixed."""
    for spec in (SORT_1D, PAIRS):
        configs = valid(spec)
        seen = set()
        for config in configs:
            steps = [asdict(s) for s in spec.steps(config, (2**24,), "float32")]
            seen.add((spec.render(config, (2**24,), "float32"), repr(steps)))
        assert len(seen) == len(configs)
    radix_configs = [c for c in valid(SORT_1D) if c["ALGO"] == "radix"]
    assert {c["RADIX_BITS"] for c in radix_configs} == set(radix.RADIX_BITS)
    # Every ranking method and histogram method on every tile and digit width: RANK and HIST
    # add no constraint today.
    methods = len(radix.RANKS) * len(radix.HISTS)
    for configs, low, high in ((radix_configs, 60, 120), (valid(PAIRS), 50, 100)):
        first = [c for c in configs if c["RANK"] == "match" and c["HIST"] == "scalar"]
        assert len(configs) == methods * len(first)
        assert low <= len(configs) / methods <= high


def test_check_fixes_what_an_algorithm_ignores() -> None:
    n = (2**20,)
    assert SORT_1D.check(radix_cfg(), n, "float32") is None
    for name, value in (("WARP_SHFL", 1), ("SMEM_FUSE", 2), ("FUSE", 3)):
        reason = SORT_1D.check({**radix_cfg(), name: value}, n, "float32")
        assert f"{name} is ignored by ALGO=radix" in reason
    bitonic = SORT_1D.default_config((2**20 - 1,), "float32")
    assert bitonic["ALGO"] == "bitonic" and SORT_1D.check(bitonic, n, "float32") is None
    assert "RADIX_BITS is ignored" in SORT_1D.check({**bitonic, "RADIX_BITS": 8}, n, "float32")
    assert bitonic["RANK"] == radix.RANKS[0] == "match"
    for rank in radix.RANKS[1:]:
        reason = SORT_1D.check({**bitonic, "RANK": rank}, n, "float32")
        assert reason == "RANK is ignored by ALGO=bitonic: fixed at match"
        assert SORT_1D.check(radix_cfg(rank=rank), n, "float32") is None
    assert bitonic["HIST"] == radix.HISTS[0] == "scalar"
    for hist in radix.HISTS[1:]:
        reason = SORT_1D.check({**bitonic, "HIST": hist}, n, "float32")
        assert reason == "HIST is ignored by ALGO=bitonic: fixed at scalar"
        assert SORT_1D.check(radix_cfg(hist=hist), n, "float32") is None
        assert PAIRS.check(pairs_cfg(hist=hist), n, "float32") is None
    assert "not one of" in SORT_1D.check(radix_cfg(hist="vec8"), n, "float32")
    assert "not one of" in SORT_1D.check(radix_cfg(rank="shuffle"), n, "float32")
    assert "not one of" in PAIRS.check(pairs_cfg(rank=1), n, "float32")
    assert "ITEMS in" in SORT_1D.check({**bitonic, "ITEMS": 16}, n, "float32")
    assert "missing" in SORT_1D.check({k: v for k, v in bitonic.items() if k != "ALGO"}, n, "int32")


def test_check_rejects_what_the_radix_sort_cannot_run() -> None:
    n = (2**20,)
    assert "2048" in SORT_1D.check(radix_cfg(block=128, items=12), n, "float32")
    assert SORT_1D.check(radix_cfg(block=128, items=16), n, "float32") is None
    # 1024 threads leave 64 registers: 2 x 16 + overhead fit keys only, not pairs.
    assert SORT_1D.check(radix_cfg(block=1024, items=16), n, "float32") is None
    assert "registers" in SORT_1D.check(radix_cfg(block=1024, items=20), n, "float32")
    assert "registers" in PAIRS.check(pairs_cfg(block=1024, items=16), n, "float32")
    assert PAIRS.check(pairs_cfg(block=512, items=24), n, "float32") is None
    big = (2**30,)
    assert "2**30" in SORT_1D.check(radix_cfg(), big, "float32")
    assert SORT_1D.check(SORT_1D.default_config(big, "float32"), big, "float32") is None
    # the measured defaults: radix from 2**20 keys up to its limit, atomic ranking
    radix_default = SORT_1D.default_config(n, "float32")
    assert (radix_default["ALGO"], radix_default["RANK"], radix_default["ITEMS"]) == (
        "radix", "atomic", 16,
    )  # fmt: skip
    assert SORT_1D.default_config(big, "float32")["ALGO"] == "bitonic"
    largest = (radix.MAX_N,)  # the last length the radix default takes
    for dtype in ("float32", "int32"):
        config = SORT_1D.default_config(largest, dtype)
        assert config["ALGO"] == "radix" and SORT_1D.check(config, largest, dtype) is None
    assert PAIRS.default_config(n, "float32")["RANK"] == "atomic"
    assert PAIRS.check(PAIRS.default_config(n, "float32"), n, "float32") is None
    with pytest.raises(InvalidInput, match="2\\*\\*30"):
        PAIRS.validate(big, "int32")
    assert "not one of" in PAIRS.check(pairs_cfg(bits=3), n, "int32")


@pytest.mark.parametrize("dtype", KEYS)
def test_every_valid_radix_config_fits_the_device_model(dtype) -> None:
    for spec, pairs in ((SORT_1D, False), (PAIRS, True)):
        for config in valid(spec, dtype=dtype):
            if config.get("ALGO", "radix") != "radix":
                continue
            launch = spec.launch(config, (2**24,), dtype)
            assert launch.shared_bytes == radix.shared_bytes(config, pairs) <= 227 * 1024
            assert radix.tile(config) >= radix.MIN_TILE
            assert launch.grid[0] == math.ceil(2**24 / radix.tile(config))


@pytest.mark.parametrize("pairs", (False, True), ids=("keys", "pairs"))
def test_shared_layout_is_what_the_kernel_indexes_and_the_launch_gives(pairs) -> None:
    """One layout for kernel and launch (issue 32: the launch counted three per-digit arrays,
    radix.cu four): every valid config's regions in radix.cu's order with its sizes, the
    kernel compiled with exactly those offsets, the launch 4 bytes per word of it."""
    spec = PAIRS if pairs else SORT_1D
    names = ["SMEM_KEYS", "SMEM_VALS", "SMEM_WARP", "SMEM_COUNT", "SMEM_START"]
    names += ["SMEM_GLOBAL", "SMEM_BASE", "SMEM_TILE", "SMEM_WORDS"]
    configs = [c for c in valid(spec) if c.get("ALGO", "radix") == "radix"]
    assert len(configs) >= 50
    for config in configs:
        layout = radix.shared_layout(config, pairs)
        assert list(layout) == names
        t, digits = radix.tile(config), 1 << config["RADIX_BITS"]
        warp_words = config["BLOCK"] // 32 * digits
        # RANK=atomic ranks with two buffers of a word per warp and digit in the keys' region.
        keys = max(t, 2 * warp_words) if config["RANK"] == "atomic" else t
        sizes = [keys, t if pairs else 0, warp_words, *[digits] * 4, 1]
        offsets = list(layout.values())
        assert offsets[0] == 0
        assert [b - a for a, b in zip(offsets, offsets[1:], strict=False)] == sizes, config
        source = spec.render(config, (2**20,), "int32")
        for name, words in layout.items():
            assert f"#define {name} {words}\n" in source
        launch = spec.launch(config, (2**20,), "int32")
        assert launch.shared_bytes == radix.shared_bytes(config, pairs) == 4 * offsets[-1]
    # The launches of the failures, now what radix.cu indexes.
    assert radix.shared_bytes({"BLOCK": 256, "ITEMS": 8, "RADIX_BITS": 4}, False) == 8964
    assert radix.shared_bytes({"BLOCK": 128, "ITEMS": 16, "RADIX_BITS": 4}, False) == 8708
    # RANK=atomic at 8 warps x 256 digits: 2 x 2048 peers words in a region of 4096 words.
    atomic = {"BLOCK": 256, "ITEMS": 8, "RADIX_BITS": 8, "RANK": "atomic"}
    assert radix.shared_layout(atomic, True)["SMEM_VALS"] == 4096
    assert radix.shared_layout({**atomic, "ITEMS": 24}, True)["SMEM_VALS"] == 256 * 24


@pytest.mark.parametrize("pairs", (False, True), ids=("keys", "pairs"))
def test_the_first_rank_renders_the_source_from_before_rank(pairs) -> None:
    """RANK="match" (the first value) renders no RANK macro: a config from before RANK (no RANK
    key) renders, launches and checks exactly as before, so its measured results still hold
    (benchmarks/relabel_results.py carries them over). The other methods render RANK 1 and 2,
    which radix.cu reads (0 when undefined)."""
    spec = PAIRS if pairs else SORT_1D
    configs = [c for c in valid(spec) if c.get("ALGO", "radix") == "radix"]
    shape = (2**20 + 3,)
    for config in configs:
        source = spec.render(config, shape, "float32")
        code = radix.RANK_MACRO[config["RANK"]]
        if code is None:
            old = {k: v for k, v in config.items() if k != "RANK"}
            assert "RANK" not in spec.defines(config, shape, "float32")
            assert source == spec.render(old, shape, "float32")
            assert spec.steps(config, shape, "float32") == spec.steps(old, shape, "float32")
            assert list(spec.defines(config, shape, "float32"))[:4] == [
                "BLOCK",
                "ITEMS",
                "RADIX_BITS",
                "PAIRS",
            ]
        else:
            assert f"#define RANK {code}\n" in source
    assert radix.RANK_MACRO == {"match": None, "ballot": 1, "atomic": 2}
    template = radix.TEMPLATE.read_text()
    assert "#ifndef RANK\n#define RANK 0\n#endif" in template
    assert "#if RANK == 0" in template and "#elif RANK == 1" in template


@pytest.mark.parametrize("pairs", (False, True), ids=("keys", "pairs"))
def test_the_first_hist_renders_the_source_from_before_hist(pairs) -> None:
    """HIST="scalar" (the first value) renders no HIST macro: a config from before HIST renders,
    launches and checks exactly as before. The vector methods render HIST 1 and 2, and only the
    histogram kernel's static counters differ between methods (the launches are the same)."""
    spec = PAIRS if pairs else SORT_1D
    configs = [c for c in valid(spec) if c.get("ALGO", "radix") == "radix"]
    shape = (2**20 + 3,)
    for config in configs:
        source = spec.render(config, shape, "float32")
        old = {k: v for k, v in config.items() if k != "HIST"}
        code = radix.HIST_MACRO[config["HIST"]]
        steps = spec.steps(config, shape, "float32")
        assert steps == spec.steps(old, shape, "float32")
        if code is None:
            assert "HIST" not in spec.defines(config, shape, "float32")
            assert source == spec.render(old, shape, "float32")
            assert radix.check(old, shape[0], pairs) is radix.check(config, shape[0], pairs) is None
        else:
            assert f"#define HIST {code}\n" in source
        copies = 4 if config["HIST"] == "vec4_split4" else 1
        bins = radix.passes(config["RADIX_BITS"]) << config["RADIX_BITS"]
        assert radix.hist_shared_bytes(config) == 4 * bins * copies <= 48 * 1024
    assert radix.HIST_MACRO == {"scalar": None, "vec4": 1, "vec4_split4": 2}
    template = radix.TEMPLATE.read_text()
    assert "#ifndef HIST\n#define HIST 0\n#endif" in template and "#if HIST == 0" in template


def _array(problem, index):
    a = problem.args[index]
    assert isinstance(a, np.ndarray), index
    return a


@pytest.mark.parametrize("n", (1, 2047, 2**16 + 3, 3 * 2**20 + 7))
@pytest.mark.parametrize("bits", radix.RADIX_BITS)
@pytest.mark.parametrize("pairs", (False, True), ids=("keys", "pairs"))
def test_launch_sequence(n, bits, pairs) -> None:
    """Init, histogram, one pass per digit; pass p reads what p-1 wrote and the last one
    writes the output; every buffer argument is the array of the layout with the size the
    kernels index."""
    spec, layout = (PAIRS, PAIRS_LAYOUT) if pairs else (SORT_1D, KEYS_LAYOUT)
    config = pairs_cfg(bits=bits) if pairs else radix_cfg(bits=bits)
    dtype = "float32" if bits % 2 else "int32"
    problem = spec.make_problem((n,), dtype, np.random.default_rng(0))
    steps = spec.steps(config, (n,), dtype)
    count = radix.passes(bits)
    assert [s.kernel for s in steps] == ["radix_init", "radix_histogram"] + ["radix_pass"] * count
    init, hist, *scatter = steps
    assert init.args == (layout.hist, layout.counters, layout.status, layout.n)
    assert hist.args == (layout.keys_in, layout.n, layout.hist, layout.scalar(dtype == "float32"))
    assert init.launch.block == hist.launch.block == (radix.AUX_BLOCK, 1, 1)
    assert problem.args[layout.n] == n and isinstance(problem.args[layout.n], np.int64)
    tiles = math.ceil(n / radix.tile(config))
    assert _array(problem, layout.status).size >= 2 * tiles * (1 << bits)
    assert _array(problem, layout.hist).size >= count << bits
    assert _array(problem, layout.counters).size >= count
    source_keys, source_vals = layout.keys_in, layout.vals_in
    for p, step in enumerate(scatter):
        assert step.launch.grid == (tiles, 1, 1)
        assert step.launch.shared_bytes == radix.shared_bytes(config, pairs)
        keys_in, keys_out = step.args[:2]
        assert keys_in == source_keys and keys_out != keys_in
        assert _array(problem, keys_out).size == n and _array(problem, keys_out).dtype.itemsize == 4
        tail = step.args[4:] if pairs else step.args[2:]
        assert tail == (
            layout.n,
            layout.hist,
            layout.counters,
            layout.status,
            layout.scalar(p),
            layout.scalar(dtype == "float32"),
        )
        if pairs:
            assert step.args[2] == source_vals and step.args[3] != step.args[2]
            assert _array(problem, step.args[3]).dtype == np.int32
            source_vals = step.args[3]
        source_keys = keys_out
    assert source_keys == layout.keys_out and problem.outputs[0] == layout.keys_out
    if pairs:
        assert source_vals == layout.vals_out and problem.outputs == [2, 3]
    assert layout.keys_in not in [s.args[1] for s in scatter]  # the input is never written


def test_scratch_is_counted_in_the_buffer_bytes() -> None:
    for spec in (SORT_1D, PAIRS):
        for n in (1, 5000, 2**20 + 1):
            problem = spec.make_problem((n,), "int32", np.random.default_rng(1))
            assert spec.buffer_bytes((n,), "int32") == problem.nbytes
    # Beyond the radix sort's reach the bitonic problem carries one-word stand-ins.
    assert SORT_1D.buffer_bytes((2**31,), "float32") < 2 * 2**31 * 4 + 2**20


@pytest.mark.parametrize("dtype", KEYS)
def test_pairs_problem_reference_is_the_stable_order(dtype) -> None:
    problem = PAIRS.make_problem((3001,), dtype, np.random.default_rng(3))
    x, v = problem.args[0], problem.args[1]
    np.testing.assert_array_equal(v, np.arange(3001))
    keys_ref, vals_ref = problem.references
    np.testing.assert_array_equal(keys_ref, np.sort(x.astype(np.float64)))
    assert len(set(vals_ref.tolist())) == 3001
    np.testing.assert_array_equal(x[vals_ref].astype(np.float64), keys_ref)
    # Ties keep input order: within a run of equal keys the indices increase.
    ordered = radix.ordered_keys(x)[vals_ref]
    ties = ordered[1:] == ordered[:-1]
    assert ties.sum() > 100  # make_keys draws a third of the keys from 16 values
    assert (np.diff(vals_ref)[ties] > 0).all()
    assert (np.isnan(problem.args[2]) if dtype == "float32" else problem.args[2] == -12345).all()
    assert (problem.args[3] == -1).all()


def test_key_order_puts_negative_zero_first_and_keeps_ties() -> None:
    x = np.array([0.0, -0.0, 1.0, -np.inf, -0.0, np.inf, -1.5, 0.0], np.float32)
    order = radix.stable_order(x)
    np.testing.assert_array_equal(order, [3, 6, 1, 4, 0, 7, 2, 5])
    ints = np.array([5, -(2**31), 2**31 - 1, -1, 0, 5, -(2**31)], np.int32)
    np.testing.assert_array_equal(radix.stable_order(ints), [1, 6, 3, 4, 0, 5, 2])
    # The unsigned order is the value order.
    keys = np.array([-np.inf, -2.0, -0.0, 0.0, 1e-30, 3.0, np.inf], np.float32)
    assert (np.diff(radix.ordered_keys(keys).astype(np.int64)) > 0).all()


def test_the_radix_template_is_part_of_the_version(tmp_path) -> None:
    """A change to radix.cu changes sort_1d's version although its main template is sort.cu;
    the bitonic source is the same with or without the radix path."""
    from kato.kernels.sort import Sort1dSpec

    same, changed = tmp_path / "same.cu", tmp_path / "changed.cu"
    same.write_text(radix.TEMPLATE.read_text())
    changed.write_text(radix.TEMPLATE.read_text() + "\n// changed\n")

    def version(path):
        spec = Sort1dSpec()
        spec.extra_templates = (path,)
        return spec.version

    assert version(same) == SORT_1D.version != version(changed)
    bitonic = SORT_1D.render(SORT_1D.default_config((10,), "float32"), (10,), "float32")
    assert "radix" not in bitonic and "ALGO" not in bitonic
    assert SORT_1D.render(radix_cfg(), (10,), "float32").endswith(radix.TEMPLATE.read_text())
