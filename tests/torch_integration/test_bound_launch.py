"""What BoundOperator.run hands cuLaunchKernel, without a GPU: the driver's launch and context
calls replaced by recorders, so the straight path (every step, every argument) and the checked
path (chosen steps, or an argument given as None) can be compared launch by launch."""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch
from kato.kernels import get_operator
from kato.kernels.spec import Launch

from kato_torch import _driver, _kernels
from kato_torch._kernels import BoundOperator, _Call

STREAM = 0x5EED


@pytest.fixture
def launches(monkeypatch):
    """The launches BoundOperator.run makes: (function, grid, block, shared bytes, stream,
    argument values read back from the addresses cuLaunchKernel would read)."""
    made = []

    def launch_params(func, grid, block, shared_bytes, stream, params):
        kinds = _kinds[func.value]
        values = [
            kind.from_address(address).value for kind, address in zip(kinds, params, strict=True)
        ]
        made.append((func.value, tuple(grid), tuple(block), shared_bytes, stream, values))

    monkeypatch.setattr(_driver, "launch_params", launch_params)
    monkeypatch.setattr(_driver, "on_device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(_kernels, "_current_stream", lambda index: STREAM)
    return made


#: Per fake function: the ctypes kind of each argument its step passes.
_kinds: dict[int, list[type]] = {}


def _bound() -> BoundOperator:
    # Two steps over four arguments (three arrays, one int) and a fifth array no step reads.
    signature = [None, None, None, ctypes.c_int, None]
    steps = [(11, (0, 1, 3), Launch((4, 1, 1), (128, 1, 1), 256)),
             (12, (1, 2, 3), Launch((1, 1, 1), (32, 1, 1), 0))]  # fmt: skip
    calls = []
    for func, args, launch in steps:
        _kinds[func] = [ctypes.c_void_p if signature[a] is None else signature[a] for a in args]
        calls.append(_Call(f"k{func}", ctypes.c_void_p(func), launch, args))
    return BoundOperator(get_operator("relu"), (8,), "float32", {}, "test", calls, signature, 0)


def test_the_straight_path_launches_what_the_checked_path_does(launches):
    bound = _bound()
    a, b, c = torch.zeros(4), torch.zeros(8), torch.zeros(16)
    bound.run([a, b, c, 7, torch.zeros(2)])
    straight = list(launches)
    launches.clear()
    bound.run([a, b, c, 7, torch.zeros(2)], steps=[0, 1])  # the checked path
    assert straight == launches
    assert straight == [
        (11, (4, 1, 1), (128, 1, 1), 256, STREAM, [a.data_ptr(), b.data_ptr(), 7]),
        (12, (1, 1, 1), (32, 1, 1), 0, STREAM, [b.data_ptr(), c.data_ptr(), 7]),
    ]
    # New tensors and a new scalar on the next call: nothing stale from the first.
    d, e = torch.zeros(32), torch.zeros(64)
    launches.clear()
    bound.run([d, e, c, 9, None])  # an array no step reads may be None
    assert launches == [
        (11, (4, 1, 1), (128, 1, 1), 256, STREAM, [d.data_ptr(), e.data_ptr(), 9]),
        (12, (1, 1, 1), (32, 1, 1), 0, STREAM, [e.data_ptr(), c.data_ptr(), 9]),
    ]


def test_a_step_chosen_alone_and_a_missing_argument(launches):
    bound = _bound()
    a, b, c = torch.zeros(4), torch.zeros(8), torch.zeros(16)
    bound.run([a, b, None, 3, None], steps=[0])  # step 1 (which reads c) not launched
    assert [launch[0] for launch in launches] == [11]
    with pytest.raises(TypeError, match="kernel k12 needs an argument given None"):
        bound.run([a, b, None, 3, None])
    with pytest.raises(TypeError, match="takes 5 arguments, got 4"):
        bound.run([a, b, c, 3])


def test_a_pointer_off_the_asked_alignment_launches_nothing(launches):
    """``aligned_to``: kato_torch binds for 16-byte pointers first and lets the launch check
    them while it reads them; a view a few elements into its storage must raise before any
    step runs (a 16-byte vector on it would fault and poison the context)."""
    bound = _bound()
    storage = torch.zeros(64)
    a, b, c = storage[:4], torch.zeros(8), torch.zeros(16)
    bound.run([a, b, c, 1, None], aligned_to=16)
    assert len(launches) == 2
    launches.clear()
    # 12 bytes into the storage is 4-byte aligned: the message says what the view allows.
    for view, allows in ((storage[1:5], 4), (storage[2:6], 8), (storage[3:7], 4)):
        with pytest.raises(_kernels.MisalignedArguments, match=f"only {allows}-byte aligned"):
            bound.run([a, view, c, 1, None], aligned_to=16)
        bound.run([a, view, c, 1, None], aligned_to=allows)  # what the view does allow
    assert len(launches) == 6
    # A scalar never counts, whatever its value.
    launches.clear()
    bound.run([a, b, c, 3, None], aligned_to=16)
    assert len(launches) == 2


def test_a_refused_call_asks_for_no_stream_module(launches, monkeypatch):
    """A per-stream operator loads a module at its first call on a stream: a call refused for
    its alignment must not load one (nor inside a CUDA-graph capture)."""
    asked: list[int] = []
    monkeypatch.setattr(
        BoundOperator, "calls_on", lambda self, stream: asked.append(stream) or self.calls
    )
    bound = _bound()
    storage = torch.zeros(64)
    with pytest.raises(_kernels.MisalignedArguments):
        bound.run([storage[:4], storage[1:5], torch.zeros(16), 1, None], aligned_to=16)
    assert asked == [] and launches == []
    bound.run([storage[:4], torch.zeros(8), torch.zeros(16), 1, None], aligned_to=16)
    assert asked == [STREAM] and len(launches) == 2
