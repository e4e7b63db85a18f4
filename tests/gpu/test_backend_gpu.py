"""The pycuda backend's own mechanics on a real GPU: the shared-memory opt-in, what
verification starts from and how it poisons, and timing that measures the GPU, not Python."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kato.kernels import get_operator
from kato.kernels.layernorm import static_shared_bytes as layernorm_static
from kato.kernels.limits import SHARED_WITHOUT_OPT_IN
from kato.kernels.softmax import static_shared_bytes as softmax_static
from kato.tuner.backends.base import TrialStatus
from stateful_op import StatefulCopySpec


def _backend(spec, shape, dtype, **kwargs):
    from kato.tuner.backends.pycuda import PyCudaBackend

    kwargs.setdefault("repeats", 3)
    kwargs.setdefault("warmup", 1)
    return PyCudaBackend(spec, shape, dtype, seed=2, **kwargs)


# --- shared memory ------------------------------------------------------------------------------


def test_a_config_whose_static_and_dynamic_shared_memory_pass_48k_launches():
    """Softmax (64, 12288) float32, one block per row, the row in shared memory: exactly 48 KiB
    dynamic plus the block reduction's static array. Opting in on the dynamic part alone left
    it a launch_error."""
    spec = get_operator("softmax")
    config = {"BLOCK_SIZE": 1024, "VEC": 4, "STRATEGY": 1, "CACHE": 1, "MIN_BLOCKS": 0, "LANES": 32}
    launch = spec.launch(config, (64, 12288), "float32")
    assert launch.shared_bytes == SHARED_WITHOUT_OPT_IN and softmax_static(config) > 0
    backend = _backend(spec, (64, 12288), "float32")
    try:
        result = backend.evaluate(config)
        assert result.status == TrialStatus.OK, result.error
        assert result.shared_static_bytes == softmax_static(config)
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("name", "static"), [("softmax", softmax_static), ("layernorm", layernorm_static)]
)
def test_every_config_across_the_48k_line_verifies(name, static):
    """Every valid config of a 12288-wide float32 row whose dynamic shared memory fits 48 KiB
    but whose total does not (57 softmax and 72 layernorm configs failed to launch before)."""
    spec = get_operator(name)
    shape = (64, 12288)
    backend = _backend(spec, shape, "float32")
    try:
        edge = [
            c
            for c in backend.space().valid_configs()
            if 0 < (d := spec.launch(c, shape, "float32").shared_bytes) <= SHARED_WITHOUT_OPT_IN
            and d + static(c) > SHARED_WITHOUT_OPT_IN
        ]
        assert len(edge) >= 20
        backend.precompile(edge)
        failures = []
        for config in edge:
            calls = backend.load(backend.compile(config), spec.steps(config, shape, "float32"))
            if error := backend.verify(calls):
                failures.append((config, error))
        assert failures == []
    finally:
        backend.close()


# --- verification -------------------------------------------------------------------------------


def test_verification_starts_from_the_problem_as_made_not_from_the_last_config():
    """MODE 2 copies what MODE 0 left in scratch: it passed when verified after MODE 0 on the
    same buffers. MODE 1 works once and leaves its counter set: the second call writes nothing."""
    backend = _backend(StatefulCopySpec(), (5000,), "float32")
    try:
        assert backend.evaluate({"MODE": 0}).status == TrialStatus.OK
        stale = backend.evaluate({"MODE": 2})
        assert stale.status == TrialStatus.VERIFY_ERROR
        assert "5000 of 5000 elements" in stale.error
        once = backend.evaluate({"MODE": 1})
        assert once.status == TrialStatus.VERIFY_ERROR
        assert once.error.endswith("(on a second call)")
        assert backend.evaluate({"MODE": 0}).status == TrialStatus.OK
    finally:
        backend.close()


def test_an_unwritten_sort_output_fails_even_where_the_keys_hold_minus_one():
    """int32 keys: all bits set (-1) is a real key, so the poison is a value the sorted keys do
    not hold, and an output left unwritten cannot match."""
    from kato.tuner.backends.pycuda import poison_word

    spec = get_operator("sort")
    backend = _backend(spec, (4, 1024), "int32")
    try:
        backend.prepare()
        ref = backend.problem.references[0]
        word = backend._poisons[0]
        assert word == poison_word(np.dtype(np.int32), ref)
        assert not (ref.astype(np.int32).view(np.uint32) == word).any()
        # An output nobody writes keeps the poison: the comparison rejects every element.
        backend._poison_outputs(backend._arg_sets[0])
        error = backend._compare(backend._arg_sets[0])
        assert error is not None and f"{ref.size} of {ref.size} elements" in error
    finally:
        backend.close()


# --- timing -------------------------------------------------------------------------------------


def test_a_short_kernel_is_timed_below_the_rate_python_launches_it():
    """ReLU forward + backward on 4096 elements runs in a few us; Python queues one call in
    more than that. The timed batch is queued behind a spin, so it reads GPU time."""
    spec = get_operator("relu")
    shape, dtype = (4096,), "float32"
    backend = _backend(spec, shape, dtype, repeats=7, warmup=3)
    try:
        config = spec.default_config(shape, dtype)
        calls = backend.load(backend.compile(config), spec.steps(config, shape, dtype))
        assert backend.verify(calls) is None
        launches = 2000
        args = backend._arg_sets[0]
        t0 = time.perf_counter()
        for _ in range(launches):
            backend._launch(calls, args)
        host_ms = (time.perf_counter() - t0) * 1e3 / launches
        backend.cuda.Context.synchronize()
        times = backend.time(calls)
        assert float(np.median(times)) < 0.7 * host_ms, (times, host_ms)
    finally:
        backend.close()


def test_small_problems_rotate_enough_copies_to_stream_from_memory():
    """A 4 MiB softmax gets copies that together hold twice the L2 (8 was the cap before: 32
    MiB, inside the H200's 60 MiB L2), and the rotation runs on across repeats."""
    spec = get_operator("softmax")
    shape, dtype = (1024, 1024), "float16"
    backend = _backend(spec, shape, dtype, repeats=4, warmup=0)
    try:
        backend.prepare()
        touched = spec.bytes_moved(shape, dtype)
        assert len(backend._arg_sets) * touched >= 2 * backend.gpu.l2_bytes
        config = spec.default_config(shape, dtype)
        calls = backend.load(backend.compile(config), spec.steps(config, shape, dtype))
        before = backend._next_set
        backend.time(calls)
        assert backend._next_set - before > len(backend._arg_sets)  # wrapped, not restarted
    finally:
        backend.close()
