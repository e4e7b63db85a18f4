"""The cross_entropy spec: constraints, defaults, rendering, launch geometry and steps, problems,
references (against torch's F.cross_entropy in float64) and tolerances."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, Launch, get_operator, list_operators
from kato.kernels.cross_entropy import CrossEntropySpec, lse_atol, model

SPEC = get_operator("cross_entropy")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
SHAPES = [
    (1, 1),
    (1, 2),
    (3, 7),
    (1000, 1),
    (65536, 128),
    (1, 32000),
    (16, 50257),
    (8192, 50257),
    (4096, 128256),
    (1, 256000),
    (16384, 256000),
    (7, 1000003),
]


def cfg(block=256, vec=4, row_threads=0, min_blocks=0, split=1):
    return {
        "BLOCK_SIZE": block,
        "VEC": vec,
        "ROW_THREADS": row_threads,
        "MIN_BLOCKS": min_blocks,
        "SPLIT": split,
    }


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, CrossEntropySpec) and SPEC in list_operators()
    assert SPEC.kernel_name == "cross_entropy_fwd"
    assert SPEC.kernel_names == ("cross_entropy_fwd", "cross_entropy_combine")
    assert SPEC.rank == 2 and SPEC.shape_names == ("rows", "cols")
    assert SPEC.dtypes == DTYPE_NAMES
    assert list(SPEC.params) == ["BLOCK_SIZE", "VEC", "ROW_THREADS", "MIN_BLOCKS", "SPLIT"]
    assert SPEC.space_size() == 4 * 4 * 4 * 2 * 7
    text = SPEC.template.read_text()
    assert text.count('extern "C" __global__') == 2 and "namespace KATO_NS" in text
    assert len(SPEC.version) == 12


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (64, 1024), "float32", "32-byte vector"),
        (cfg(block=1024, min_blocks=2), (64, 1024), "float32", "cap registers at 32"),
        (cfg(split=2), (4, 1000), "float32", "fewer than one vector"),  # 504 < 256 x 4
        (cfg(row_threads=8, vec=1, split=64), (4, 100), "float32", "last chunk"),  # 8 x 63 > 100
        (cfg(row_threads=8, vec=1, split=2), (4, 1), "float16", "last chunk"),
        (cfg(), (64, 1024), "int32", "does not support dtype"),
        (cfg(), (64, 0), "float32", "at least 1"),
        (cfg(), (64, 2**31 - 2**16 + 1), "float32", "2**31-2**16 columns"),
        (cfg(), (2**31, 64), "float32", "2**31-1 rows"),
        (cfg(), (64, 1024, 1), "float32", "rank 2"),
        (cfg(split=3), (64, 1024), "float32", "not one of"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


def test_check_rejects_missing_and_unknown_parameters() -> None:
    partial = cfg()
    del partial["SPLIT"]
    assert "missing parameter SPLIT" in SPEC.check(partial, (4, 64), "float32")
    assert "unknown parameter" in SPEC.check({**cfg(), "CACHE": 0}, (4, 64), "float32")


@pytest.mark.parametrize(
    ("config", "shape", "dtype"),
    [
        (cfg(vec=4), (64, 1022), "float32"),  # any cols with any VEC: head and tail
        (cfg(vec=8), (64, 50257), "bfloat16"),
        (cfg(vec=8, row_threads=8), (64, 3), "float16"),  # shorter than a vector
        (cfg(vec=1), (7, 1000003), "float32"),
        (cfg(block=512, min_blocks=2), (64, 1024), "bfloat16"),  # exactly 2048 threads
        (cfg(block=1024, vec=8, split=64), (1, 524288), "bfloat16"),  # chunks of 8192
        (cfg(row_threads=8, vec=1, split=8), (4, 64), "float32"),  # chunks of 8, all full
        (cfg(block=128, vec=8, split=4), (16, 50257), "float16"),
    ],
)
def test_check_accepts(config, shape, dtype) -> None:
    assert SPEC.check(config, shape, dtype) is None


def test_chunks_cover_the_row_in_multiples_of_8() -> None:
    for cols in (1, 9, 1031, 50257, 128256):
        for split in model.SPLITS:
            per = model.chunk_cols(cols, split)
            assert per * split >= cols and (split == 1 or per % 8 == 0)
            assert split == 1 or per - 8 < -(-cols // split)  # no more than the rounding
    assert model.chunk_cols(50257, 1) == 50257 and model.chunk_cols(50257, 4) == 12568


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_valid_for_every_shape(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert set(config) == set(SPEC.params)
    assert SPEC.check(config, shape, dtype) is None
    assert SPEC.launch(config, shape, dtype).grid[0] >= 1


def test_default_config_splits_few_long_rows_only() -> None:
    few = SPEC.default_config((16, 128256), "bfloat16")
    assert few["ROW_THREADS"] == 0 and few["SPLIT"] > 1
    assert SPEC.launch(few, (16, 128256), "bfloat16").grid[0] >= 2 * 132  # every SM, twice
    one = SPEC.default_config((1, 256000), "float32")
    assert one["SPLIT"] == 64 and one["BLOCK_SIZE"] == 256
    many = SPEC.default_config((8192, 50257), "bfloat16")
    assert (many["SPLIT"], many["ROW_THREADS"], many["VEC"]) == (1, 0, 8)
    short = SPEC.default_config((65536, 128), "float32")
    assert (short["ROW_THREADS"], short["SPLIT"], short["VEC"]) == (8, 1, 4)
    with pytest.raises(InvalidInput):
        SPEC.default_config((0, 4), "float32")


def test_render_defines_first_and_sources_do_not_depend_on_the_shape() -> None:
    source = SPEC.render(cfg(block=128, vec=8, row_threads=16, split=4), (10, 1000), "float16")
    assert source.splitlines()[:8] == [
        "#define VEC 8",
        "#define ROW_THREADS 16",
        "#define SPLIT 4",
        "#define LB_THREADS 256",
        "#define LB_MIN_BLOCKS 0",
        "#define DTYPE __half",
        "#define IS_HALF 1",
        "#define IS_BF16 0",
    ]
    same = [cfg(block=128, row_threads=32), cfg(block=256, row_threads=32)]
    assert len({SPEC.render(c, (4, 1024), "float32") for c in same}) == 1
    assert SPEC.render(cfg(), (4, 1024), "float32") == SPEC.render(cfg(), (99, 77), "float32")


def test_launch_geometry_and_steps() -> None:
    warp = SPEC.launch(cfg(block=256, row_threads=16), (1000, 128), "float32")
    assert warp == Launch(grid=(63, 1, 1), block=(256, 1, 1))  # 16 rows per block
    [only] = SPEC.steps(cfg(block=512), (70, 4100), "float16")
    assert only.kernel == "cross_entropy_fwd" and only.launch.grid == (70, 1, 1)
    main, combine = SPEC.steps(cfg(block=128, vec=8, split=8), (300, 50257), "bfloat16")
    assert main.launch == Launch(grid=(2400, 1, 1), block=(128, 1, 1))  # a block per chunk
    assert combine.kernel == "cross_entropy_combine"
    assert combine.launch == Launch(grid=(2, 1, 1), block=(256, 1, 1))  # a thread per row
    assert main.args is None and combine.args is None
    assert SPEC.launch(cfg(block=128), (2**31 - 1, 1), "float32").grid[0] == 2**31 - 1


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    problem = SPEC.make_problem((37, 301), dtype, np.random.default_rng(1))
    logits, labels, loss, lse, partials, rows, cols, ignore = problem.args
    assert logits.dtype == DTYPES[dtype][0] and logits.shape == (37, 301)
    assert labels.dtype == np.int64 and labels.shape == (37,)
    assert (rows, cols, ignore) == (37, 301, -100) and isinstance(ignore, np.int64)
    assert loss.dtype == lse.dtype == partials.dtype == np.float32
    assert partials.size == 2 * model.MAX_SPLIT * 37
    assert problem.outputs == [2, 3] and np.isnan(loss).all() and np.isnan(lse).all()
    ignored = labels == -100
    assert ignored.sum() == len(range(3, 37, 8)) and ignored[3] and ignored[11]
    assert ((labels[~ignored] >= 0) & (labels[~ignored] < 301)).all()
    x = logits.astype(np.float64)
    assert x[0].mean() > 90 and x[2].mean() < -90  # exp(100) overflows float32
    ref_loss, ref_lse = problem.references
    assert (ref_loss[ignored] == 0).all() and (ref_loss[~ignored] > 0).all()
    (loss_atol, loss_rtol), (lse_atol_, lse_rtol) = problem.tolerances
    assert lse_atol_ == lse_atol(301) and lse_rtol == loss_rtol == 2.0**-23
    assert loss_atol == pytest.approx(lse_atol(301) + 2.0**-23 * np.abs(ref_lse).max())


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_reference_matches_torch(dtype) -> None:
    """loss = F.cross_entropy(reduction='none', ignore_index) and lse = torch.logsumexp, in
    float64 from the logits as stored, for the default and for another ignore index."""
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional
    problem = SPEC.make_problem((45, 1031), dtype, np.random.default_rng(3))
    logits, labels = problem.args[0], problem.args[1]
    x = torch.from_numpy(logits.astype(np.float64))
    t = torch.from_numpy(labels)
    want = functional.cross_entropy(x, t, reduction="none", ignore_index=-100).numpy()
    np.testing.assert_allclose(problem.references[0], want, rtol=1e-13, atol=1e-12)
    np.testing.assert_allclose(
        problem.references[1], torch.logsumexp(x, dim=-1).numpy(), rtol=1e-13, atol=1e-12
    )
    other = labels.copy()
    other[other == -100] = 7
    loss, _ = model.cross_entropy_reference(logits, other, ignore_index=7)
    want = functional.cross_entropy(x, torch.from_numpy(other), reduction="none", ignore_index=7)
    np.testing.assert_allclose(loss, want.numpy(), rtol=1e-13, atol=1e-12)
    assert (loss[other == 7] == 0).all()


def test_reference_out_of_range_labels_are_nan() -> None:
    logits = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    loss, lse = model.cross_entropy_reference(logits, np.array([5, -1, 2, -100]))
    assert np.isnan(loss[:2]).all() and np.isfinite(loss[2]) and loss[3] == 0
    assert np.isfinite(lse).all()


LOG2E = np.float32(1.4426950408889634)


def _exp(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    return np.exp2((x - m) * LOG2E).astype(np.float32)


def _replay_lse(x: np.ndarray, threads: int, per_step: int, compensated: bool) -> np.ndarray:
    """The forward kernel's float32 arithmetic with VEC=1 (no head or tail): ``threads`` threads
    of a row, each taking ``per_step`` of its columns per step (columns t, t + threads, ...), a
    step's terms summed in order, the running sum rescaled and (``compensated``) Neumaier-
    compensated as ``add_compensated`` does, then the threads' (max, sum) merged as a tree.
    ``compensated=False`` is the plain running sum over every element (the first version)."""
    rows, cols = x.shape
    width = -(-cols // threads) * threads
    padded = np.full((rows, width), -np.inf, dtype=np.float32)
    padded[:, :cols] = x.astype(np.float32)
    per = padded.reshape(rows, width // threads, threads).transpose(0, 2, 1)  # (rows, t, k)
    m = np.full((rows, threads), -np.inf, dtype=np.float32)
    s = np.zeros((rows, threads), dtype=np.float32)
    comp = np.zeros_like(s)
    step_len = per_step if compensated else 1
    for k in range(0, per.shape[2], step_len):
        seg = per[:, :, k : k + step_len]
        mb = np.maximum(m, seg.max(axis=2))
        step = np.zeros_like(s)
        for u in range(seg.shape[2]):
            step = (step + _exp(seg[:, :, u], mb)).astype(np.float32)
        with np.errstate(invalid="ignore"):
            r = np.where(np.isneginf(m), np.float32(0), _exp(m, mb))
        s = (s * r).astype(np.float32)
        comp = (comp * r).astype(np.float32)
        total = (s + step).astype(np.float32)
        if compensated:
            comp += (np.maximum(s, step) - total) + np.minimum(s, step)
        s, m = total, mb
    s = (s + comp).astype(np.float32)
    while m.shape[1] > 1:
        half = m.shape[1] // 2
        m1, m2, s1, s2 = m[:, :half], m[:, half:], s[:, :half], s[:, half:]
        mm = np.maximum(m1, m2)
        s = (s1 * _exp(m1, mm) + s2 * _exp(m2, mm)).astype(np.float32)
        m = mm
    return (m[:, 0] + np.log(s[:, 0])).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cols", [1031, 128256])
def test_tolerance_holds_the_kernels_float32_sums_and_catches_a_lost_vector(cols, dtype) -> None:
    """The kernel's float32 algorithm at its longest running sums (8 threads a row, one element
    per load, 4 per step) is within the problem's tolerance, in float32 and in bfloat16 (whose
    rows at +-100 repeat a few values); leaving out 8 elements (a vector) of a row is not."""
    problem = SPEC.make_problem((8, cols), dtype, np.random.default_rng(5))
    logits = problem.args[0]
    _, (atol, rtol) = problem.tolerances
    ref = problem.references[1]
    got = _replay_lse(logits, 8, 4, compensated=True).astype(np.float64)
    assert np.all(np.abs(got - ref) <= atol + rtol * np.abs(ref))
    lost = model.logsumexp(logits[:, 8:])
    assert np.all(np.abs(lost - ref) > atol + rtol * np.abs(ref))


def test_an_uncompensated_running_sum_drifts_past_the_tolerance() -> None:
    """Why the kernel compensates: a plain float32 running sum over 16032 bfloat16 logits per
    thread (8 threads on 128256 columns) drifts past lse's tolerance on the rows at +-100, as
    the first version did on the H200 (4.1e-5)."""
    problem = SPEC.make_problem((4, 128256), "bfloat16", np.random.default_rng(5))
    _, (atol, rtol) = problem.tolerances
    ref = problem.references[1]
    plain = _replay_lse(problem.args[0], 8, 4, compensated=False).astype(np.float64)
    assert np.any(np.abs(plain - ref) > atol + rtol * np.abs(ref))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_rounded_reference_is_within_tolerance(dtype) -> None:
    problem = SPEC.make_problem((16, 1000), dtype, np.random.default_rng(8))
    for ref, (atol, rtol) in zip(problem.references, problem.tolerances, strict=True):
        ideal = ref.astype(np.float32).astype(np.float64)
        np.testing.assert_allclose(ideal, ref, atol=atol, rtol=rtol)
        bumped = ref + 2 * (atol + rtol * np.abs(ref))
        assert not np.allclose(bumped, ref, atol=atol, rtol=rtol)


def test_bytes_moved_and_buffers() -> None:
    assert SPEC.bytes_moved((8192, 50257), "bfloat16") == 8192 * 50257 * 2 + 16 * 8192
    problem = SPEC.make_problem((3, 5), "float32", np.random.default_rng(0))
    assert problem.nbytes == SPEC.buffer_bytes((3, 5), "float32")
