"""Views that start a few elements into their storage (issue 31): kato_torch reads the data
pointers' common alignment and binds a variant whose vectors fit it, instead of launching the
served config's 16-byte vectors on a pointer they would fault on."""

from __future__ import annotations

import pytest
import torch
from kato.kernels import get_operator
from kato.kernels.registry import list_operators

from kato_torch._kernels import (
    VECTOR_PARAMS,
    MisalignedArguments,
    fit_alignment,
    pointer_alignment,
)


def _check_alignment(args, aligned_to: int) -> None:
    """What BoundOperator.run does with ``aligned_to`` before it launches."""
    if pointer_alignment(args) < aligned_to:
        raise MisalignedArguments(f"pointers aligned to {pointer_alignment(args)} bytes")


def test_pointer_alignment_is_the_common_power_of_two() -> None:
    storage = torch.zeros(64, dtype=torch.float16)
    assert storage.data_ptr() % 16 == 0
    assert pointer_alignment([storage, 3, 0.5, None]) == 16
    assert pointer_alignment([storage[1:]]) == 2
    assert pointer_alignment([storage[2:]]) == 4
    assert pointer_alignment([storage[4:], storage]) == 8
    assert pointer_alignment([storage[8:], storage[6:]]) == 4
    assert pointer_alignment([torch.zeros(4, dtype=torch.float32)[3:]]) == 4


def test_fit_alignment_narrows_vec_only_where_the_pointers_need_it() -> None:
    spec = get_operator("softmax")
    shape, dtype = (37, 1001), "float16"
    config = {"BLOCK_SIZE": 256, "VEC": 8, "STRATEGY": 1, "CACHE": 0, "MIN_BLOCKS": 0, "LANES": 32}
    assert fit_alignment(spec, config, shape, dtype, 16) == config
    assert fit_alignment(spec, config, shape, dtype, 8)["VEC"] == 4
    assert fit_alignment(spec, config, shape, dtype, 4)["VEC"] == 2
    narrowed = fit_alignment(spec, config, shape, dtype, 2)
    assert narrowed == {**config, "VEC": 1}
    assert spec.check(narrowed, shape, dtype) is None
    # A narrower vector that no longer fits the register cache is not offered.
    cached = {"BLOCK_SIZE": 32, "VEC": 8, "STRATEGY": 0, "CACHE": 2, "MIN_BLOCKS": 0, "LANES": 32}
    assert spec.check(cached, (4, 4096), dtype) is None
    assert fit_alignment(spec, cached, (4, 4096), dtype, 2) is None


@pytest.mark.parametrize("hw", [(7, 7), (14, 14), (8, 8)])
@pytest.mark.parametrize(
    "name", ["batchnorm", "batchnorm_backward", "batchnorm_add_relu", "batchnorm_relu_backward"]
)
def test_fit_alignment_narrows_the_elementwise_pass_vector_too(name, hw) -> None:
    """The batchnorm family's elementwise pass loads x and stores y in APPLY_VEC vectors of
    its own: a view 4 bytes into its storage got VEC narrowed and APPLY_VEC's 16-byte vectors
    kept (a misaligned-address fault, which poisons the CUDA context)."""
    spec = get_operator(name)
    shape, dtype = (2, 3, *hw), "float16"
    config = {**spec.default_config(shape, dtype), "VEC": 8, "APPLY_VEC": 8, "UNROLL": 2}
    assert spec.check(config, shape, dtype) is None
    for alignment, width in ((8, 4), (4, 2), (2, 1)):
        narrowed = fit_alignment(spec, config, shape, dtype, alignment)
        assert narrowed == {**config, "VEC": width, "APPLY_VEC": width}, alignment


def test_every_vector_width_parameter_is_narrowed() -> None:
    """A parameter named like a vector width that fit_alignment does not know would keep its
    16-byte vectors on a view's pointer."""
    widths = {p for spec in list_operators() for p in spec.params if "VEC" in p}
    assert widths <= set(VECTOR_PARAMS), widths - set(VECTOR_PARAMS)


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on the GPU, so that the op takes its kernel path."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_relu_binds_for_the_alignment_of_a_view_like_every_other_op(monkeypatch) -> None:
    """relu bound its kernel for 16-byte pointers whatever it was given: a contiguous view one
    element into its storage got the served config's 16-byte vectors (a misaligned-address
    fault, which poisons the CUDA context). Its forward and backward now bind as _run does."""
    import kato_torch.ops as ops

    bound: list[int] = []

    class Bound:
        config = {"MASK": 1}

        def run(self, args, steps=None, aligned_to=1) -> None:
            _check_alignment(args, aligned_to)

    def fake_bind(operator, shape, dtype, device_index, alignment=16):
        bound.append(alignment)
        return Bound()

    monkeypatch.setattr(ops, "bind", fake_bind)
    storage = torch.zeros(65, dtype=torch.float16)
    view = storage[1:].as_subclass(_OnGpu)
    assert view.is_contiguous() and view.data_ptr() % 16 == 2
    ops._relu.impl(view)
    assert bound[-1] == 2
    mask = torch.zeros(2, dtype=torch.int32)
    ops._relu_backward.impl(view, mask, view)
    assert bound[-1] == 2
    whole = storage[:64].as_subclass(_OnGpu)
    ops._relu.impl(whole)
    assert bound[-1] == 16


def test_an_op_with_no_variant_for_a_views_alignment_runs_on_an_aligned_copy(monkeypatch) -> None:
    """A tensor-core GEMM has no VEC narrower than 16 bytes: bind raised InvalidInput for a
    float16 view one element into its storage, and kato_torch.matmul raised where torch runs.
    The misaligned inputs are now copied to fresh storage and the served config runs."""
    from kato.kernels import InvalidInput

    import kato_torch.ops as ops

    spec = get_operator("matmul")
    shape = (64, 64, 64)
    default = spec.default_config(shape, "float16")
    assert fit_alignment(spec, default, shape, "float16", 8) is None  # no narrower variant
    ran: list[list] = []

    class Bound:
        def run(self, args, steps=None, aligned_to=1) -> None:
            _check_alignment(args, aligned_to)
            ran.append(args)

    def fake_bind(operator, shape, dtype, device_index, alignment=16):
        if alignment < 16:
            raise InvalidInput(f"{operator}: no valid config for arrays aligned to {alignment}")
        return Bound()

    monkeypatch.setattr(ops, "bind", fake_bind)
    storage = torch.arange(64 * 64 + 1, dtype=torch.float16)
    a = storage[1:].view(64, 64)
    b = torch.ones(64, 64, dtype=torch.float16)
    c = torch.empty(64, 64, dtype=torch.float16)
    ops._run("matmul", shape, a, [a, b, c, 64, 64, 64])
    (args,) = ran
    assert args[0] is not a and torch.equal(args[0], a) and args[0].data_ptr() % 16 == 0
    assert args[1] is b and args[2] is c and args[3:] == [64, 64, 64]
