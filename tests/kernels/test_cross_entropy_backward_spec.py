"""The cross_entropy_backward spec: constraints, defaults, rendering, launch geometry, problems,
references (against torch autograd of F.cross_entropy in float64) and tolerances."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import DTYPES, Launch, get_operator, list_operators
from kato.kernels.cross_entropy import model
from kato.kernels.cross_entropy_backward import LABEL_ERROR, CrossEntropyBackwardSpec

SPEC = get_operator("cross_entropy_backward")
FORWARD = get_operator("cross_entropy")
DTYPE_NAMES = ("float32", "float16", "bfloat16")


def cfg(block=256, vec=4, row_threads=0, min_blocks=0, split=1):
    return {
        "BLOCK_SIZE": block,
        "VEC": vec,
        "ROW_THREADS": row_threads,
        "MIN_BLOCKS": min_blocks,
        "SPLIT": split,
    }


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, CrossEntropyBackwardSpec) and SPEC in list_operators()
    assert SPEC.kernel_name == "cross_entropy_bwd" and SPEC.kernel_names == ()
    assert SPEC.dtypes == DTYPE_NAMES and SPEC.params == FORWARD.params
    assert SPEC.space_size() == 896
    text = SPEC.template.read_text()
    assert text.count('extern "C" __global__') == 1 and "namespace KATO_NS" in text
    assert "__restrict__ dlogits" not in text and "DTYPE* logits" in text  # may alias
    assert SPEC.version != FORWARD.version


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (64, 1024), "float32", "32-byte vector"),
        (cfg(split=2), (4, 1000), "float32", "fewer than one vector"),
        (cfg(row_threads=8, vec=1, split=2), (4, 1), "float16", "last chunk"),
        (cfg(), (64, 1024), "int32", "does not support dtype"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize(
    "shape", [(1, 1), (3, 7), (65536, 128), (1, 256000), (16, 128256), (8192, 50257)]
)
def test_default_config_is_valid_and_splits_few_long_rows(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert SPEC.check(config, shape, dtype) is None
    assert (config["SPLIT"] > 1) == (shape[0] <= 16 and shape[1] > 100000)


def test_one_step_and_launch_geometry() -> None:
    [step] = SPEC.steps(cfg(block=128, vec=8, split=8), (300, 50257), "bfloat16")
    assert step.kernel == "cross_entropy_bwd"
    assert step.launch == Launch(grid=(2400, 1, 1), block=(128, 1, 1))
    warp = SPEC.launch(cfg(block=256, row_threads=16), (1000, 128), "float32")
    assert warp == Launch(grid=(63, 1, 1), block=(256, 1, 1))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    problem = SPEC.make_problem((37, 301), dtype, np.random.default_rng(1))
    logits, labels, lse, dloss, dlogits, rows, cols, ignore = problem.args
    assert logits.dtype == dlogits.dtype == DTYPES[dtype][0]
    assert logits.shape == dlogits.shape == (37, 301) and (rows, cols, ignore) == (37, 301, -100)
    assert labels.dtype == np.int64 and lse.dtype == dloss.dtype == np.float32
    assert problem.outputs == [4] and np.isnan(dlogits.astype(np.float64)).all()
    np.testing.assert_allclose(lse, model.logsumexp(logits), rtol=2**-23)
    assert (np.abs(dloss) >= 0.5).all() and (dloss < 0).any() and (dloss > 0).any()
    ref = problem.references[0]
    ignored = labels == -100
    assert ignored.any() and (ref[ignored] == 0).all()
    # Rows sum to zero (softmax sums to 1, minus the one-hot) except ignored ones.
    np.testing.assert_allclose(ref[~ignored].sum(axis=1), 0, atol=1e-5)
    [(atol, rtol)] = problem.tolerances
    assert rtol == SPEC.tolerance(dtype)[1] and atol >= SPEC.tolerance(dtype)[0]
    assert np.mean(np.abs(ref[~ignored]) > 10 * atol) > 0.95  # atol hides no element


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_reference_matches_torch_autograd(dtype) -> None:
    """dlogits equals torch's gradient of F.cross_entropy(reduction='none') with the per-row
    dloss as the incoming gradient, in float64 from the logits as stored (the lse stored as
    float32 shifts p by at most its rounding)."""
    torch = pytest.importorskip("torch")
    problem = SPEC.make_problem((45, 1031), dtype, np.random.default_rng(3))
    logits, labels, _, dloss = problem.args[:4]
    x = torch.from_numpy(logits.astype(np.float64)).requires_grad_()
    loss = torch.nn.functional.cross_entropy(x, torch.from_numpy(labels), reduction="none")
    loss.backward(torch.from_numpy(dloss.astype(np.float64)))
    np.testing.assert_allclose(problem.references[0], x.grad.numpy(), rtol=1e-5, atol=1e-12)
    exact = model.cross_entropy_backward_reference(logits, labels, model.logsumexp(logits), dloss)
    np.testing.assert_allclose(exact, x.grad.numpy(), rtol=1e-12, atol=1e-15)


def test_reference_out_of_range_labels_are_nan_rows() -> None:
    logits = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    labels = np.array([5, -1, 2, 7])
    out = model.cross_entropy_backward_reference(
        logits, labels, model.logsumexp(logits), np.ones(4, np.float32), ignore_index=7
    )
    assert np.isnan(out[:2]).all() and np.isfinite(out[2]).all() and (out[3] == 0).all()


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_rounded_reference_is_within_tolerance_and_errors_are_not(dtype) -> None:
    problem = SPEC.make_problem((16, 1000), dtype, np.random.default_rng(8))
    [(atol, rtol)] = problem.tolerances
    ref = problem.references[0]
    ideal = ref.astype(DTYPES[dtype][0]).astype(np.float64)
    np.testing.assert_allclose(ideal, ref, atol=atol, rtol=rtol)
    assert not np.allclose(ref * (1 + 4 * rtol), ref, atol=atol, rtol=rtol)
    # The one-hot left out of a row (p instead of p - 1) fails.
    labels, dloss = problem.args[1], problem.args[3]
    row = int(np.flatnonzero(labels != -100)[0])
    wrong = ref.copy()
    wrong[row, labels[row]] += dloss[row]
    assert not np.allclose(wrong, ref, atol=atol, rtol=rtol)


def test_label_atol_scales_with_the_label_probability() -> None:
    problem = SPEC.make_problem((64, 1031), "float32", np.random.default_rng(4))
    logits, labels, lse, dloss = problem.args[:4]
    kept = np.flatnonzero(labels != -100)
    p = np.exp(logits[kept, labels[kept]].astype(np.float64) - lse[kept])
    [(atol, _)] = problem.tolerances
    assert atol == pytest.approx(LABEL_ERROR * float((p * np.abs(dloss[kept])).max()))


def test_bytes_moved_and_buffers() -> None:
    assert SPEC.bytes_moved((4096, 128256), "bfloat16") == 2 * 4096 * 128256 * 2 + 16 * 4096
    problem = SPEC.make_problem((3, 5), "float32", np.random.default_rng(0))
    assert problem.nbytes == SPEC.buffer_bytes((3, 5), "float32")
