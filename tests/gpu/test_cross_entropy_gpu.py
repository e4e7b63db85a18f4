"""cross_entropy and cross_entropy_backward on a real GPU: every valid config verified (batched
compiles, every output against its float64 reference) for every dtype at an odd, prime width;
sampled configs where few long rows make SPLIT matter; the default config on awkward shapes
(1 row, 1 column, primes, vocabularies of 32000, 50257, 128256 and 256000 columns); the grid
stride; logits that start off a vector boundary; labels outside [0, cols) (NaN rows, never an
out-of-bounds read); the backward in place (dlogits written over the logits)."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import get_operator, limits
from kato.kernels.cross_entropy import model
from rowwise_harness import run_offset, verify_all

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
NAMES = ["cross_entropy", "cross_entropy_backward"]
#: 1 element, 1 column, a long odd single row, primes, short rows (several per warp), language
#: model vocabularies (50257 is odd) at few and at many rows, rows past any SPLIT's chunks.
AWKWARD = [
    (1, 1),
    (1000, 1),
    (1, 4097),
    (3000, 3001),
    (17, 333),
    (65536, 128),
    (1, 32000),
    (33, 50257),
    (1024, 50257),
    (4, 128256),
    (2, 256000),
    (5, 1000003),
]
#: Arguments that are rows of the logits' layout, per operator (logits; logits and dlogits).
ROW_ARRAYS = {"cross_entropy": (0,), "cross_entropy_backward": (0, 4)}


@pytest.fixture(scope="module", params=NAMES)
def spec(request):
    return get_operator(request.param)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_every_valid_config_verifies(spec, dtype):
    """1031 columns (prime): every row starts at another offset of a vector, so every VEC runs
    its scalar head and tail, and SPLIT up to 4 leaves chunks of a moving head too."""
    checked, sources, failures = verify_all(spec, (37, 1031), dtype)
    assert checked > 250 and sources > 100, (checked, sources)
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(3, 128256), (16, 50257)], ids=lambda s: "x".join(map(str, s)))
def test_sampled_configs_on_few_long_rows_verify(spec, shape, dtype):
    """Few vocabulary rows: every SPLIT valid there is in the sample's reach."""
    checked, _, failures = verify_all(spec, shape, dtype, max_configs=96, seed=3)
    assert checked >= 96 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_verifies(spec, shape, dtype):
    checked, _, failures = verify_all(spec, shape, dtype, max_configs=0)
    assert checked == 1 and not failures, failures


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grid_stride_over_work_items(spec, dtype, monkeypatch):
    """A grid of 7 blocks for 2000 rows (times SPLIT chunks): every row group loops."""
    monkeypatch.setattr(limits, "MAX_GRID_X", 7)
    checked, _, failures = verify_all(spec, (2000, 997), dtype, max_configs=64, seed=4)
    assert checked >= 64 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("offset", [1, 3])
def test_logits_off_a_vector_boundary(spec, dtype, offset):
    """The row arrays start ``offset`` elements past an aligned address (views into a larger
    buffer): 4096 columns, a multiple of every VEC, still get a head in every row (and chunk)."""
    shape = (64, 4096)
    default = spec.default_config(shape, dtype)
    for config in (default, {**default, "ROW_THREADS": 8, "SPLIT": 4}):
        assert spec.check(config, shape, dtype) is None
        assert run_offset(spec, config, shape, dtype, ROW_ARRAYS[spec.name], offset) == []


def _run(spec, config, shape, dtype, problem, alias=None):
    """Run one config once on ``problem``'s inputs (``alias=(k, j)``: argument k gets argument
    j's device buffer) and return every array argument as it is after the call."""
    import pycuda.autoprimaryctx  # noqa: F401 - a context for this process
    import pycuda.driver as cuda
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.nvcc import compile_kernel

    compiled = compile_kernel(
        spec.render(config, shape, dtype), spec.kernel_name, arch=describe_device(0).arch
    )
    module = cuda.module_from_buffer(compiled.cubin)
    bufs: dict[int, object] = {}
    args = []
    for k, a in enumerate(problem.args):
        if not isinstance(a, np.ndarray):
            args.append(a)
            continue
        if alias is not None and k == alias[0]:
            args.append(None)  # filled below with argument j's buffer
            continue
        bufs[k] = cuda.mem_alloc(max(a.nbytes, 1))
        cuda.memcpy_htod(bufs[k], np.ascontiguousarray(a).view(np.uint8))  # bfloat16 too
        args.append(bufs[k])
    if alias is not None:
        args[alias[0]] = bufs[alias[1]]
    for step in spec.steps(config, shape, dtype):
        fn = module.get_function(step.kernel)
        fn(*args, block=step.launch.block, grid=step.launch.grid)
    cuda.Context.synchronize()
    out = []
    for k, a in enumerate(problem.args):
        if isinstance(a, np.ndarray) and k in bufs:
            raw = np.empty(a.nbytes, dtype=np.uint8)
            cuda.memcpy_dtoh(raw, bufs[k])
            out.append(raw.view(a.dtype).reshape(a.shape))
        else:
            out.append(None)
    return out


def _configs(spec, shape, dtype):
    default = spec.default_config(shape, dtype)
    split = {**default, "ROW_THREADS": 8, "BLOCK_SIZE": 128, "SPLIT": 8}
    assert spec.check(split, shape, dtype) is None
    return [default, split]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_labels_out_of_range_give_nan_rows(spec, dtype):
    """Labels cols, -1 and 2**40 (a read there would fault) give NaN rows (loss, or every
    dlogit), another ignore index gives zeros and makes torch's -100 out of range too."""
    shape, ignore_index = (16, 50257), 5
    for config in _configs(spec, shape, dtype):
        problem = spec.make_problem(shape, dtype, np.random.default_rng(1))
        labels = problem.args[1]
        labels[0], labels[1], labels[2], labels[4] = shape[1], -1, 2**40, ignore_index
        problem.args[-1] = np.int64(ignore_index)
        out = _run(spec, config, shape, dtype, problem)
        logits = problem.args[0]
        if spec.name == "cross_entropy":
            ref, _ = model.cross_entropy_reference(logits, labels, ignore_index)
            got = out[2]
            assert got[4] == 0
        else:
            lse, dloss = problem.args[2], problem.args[3]
            ref = model.cross_entropy_backward_reference(logits, labels, lse, dloss, ignore_index)
            got = out[4].astype(np.float64)
            assert (got[4] == 0).all()
        assert np.isnan(ref[[0, 1, 2, 3]]).all()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(37, 1031), (8, 50257)], ids=lambda s: "x".join(map(str, s)))
def test_backward_in_place(dtype, shape):
    """dlogits given as the logits' own buffer: the gradient lands over the logits, within the
    tolerance of the reference, for the default config and a split one."""
    spec = get_operator("cross_entropy_backward")
    for config in _configs(spec, shape, dtype):
        problem = spec.make_problem(shape, dtype, np.random.default_rng(2))
        out = _run(spec, config, shape, dtype, problem, alias=(4, 0))
        [(atol, rtol)] = problem.tolerances
        got = out[0].astype(np.float64)
        want = problem.references[0].astype(np.float32).astype(np.float64)
        ok = (got == want) | (np.isfinite(got) & (np.abs(got - want) <= atol + rtol * np.abs(want)))
        assert ok.all(), (config, int((~ok).sum()))
