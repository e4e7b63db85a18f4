"""Torch equivalents replayed from CUDA graphs: what PyTorch's kernels cost on the GPU alone.

``benchmarks/operators.py`` times a torch equivalent by CUDA events around batches of eager
calls. For an op of a few microseconds (rmsnorm at 8192 x 768) or one that runs through the
autograd engine (a backward pass), eager calls measure the host's launch rate, not the GPU:
:func:`graphed` captures one call per input copy into a CUDA graph and replays them in turn, so
the events see PyTorch's kernels back to back, as Kato's timing (behind a spin kernel) sees its.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.torch_ops import input_copies


def graphed(
    make_inputs: Callable[[], Any], run: Callable[[Any], object], bytes_per_call: int
) -> Callable[[], object]:
    """A zero-argument function replaying the captured ``run`` of the next input copy (as
    :func:`benchmarks.torch_ops.rotating`, one graph per copy; outputs live in the graphs'
    memory pool)."""
    import torch

    # One side stream for the inputs, the warm-up and the captures: autograd runs a backward op
    # on the stream its forward op ran on, and capturing it must not touch the legacy stream.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        copies = [make_inputs() for _ in range(input_copies(bytes_per_call))]
        for inputs in copies:
            run(inputs)
    stream.synchronize()
    graphs = []
    for inputs in copies:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run(inputs)
        graphs.append(graph)
    torch.cuda.synchronize()
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(graphs)
        return graphs[state["i"]].replay()

    return call
