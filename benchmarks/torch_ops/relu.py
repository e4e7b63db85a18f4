"""The ReLU forward + backward pair as PyTorch runs it in training: ``y = relu(x)`` saves y, the
backward is ``threshold_backward(dy, y, 0)`` (reads dy and y, writes dx): 4 streams of n
elements, against the bitmask pair's 4 streams plus n/32 words written and read."""

from __future__ import annotations

from benchmarks.torch_ops import rotating

CASES = [((2**28,), d) for d in ("float32", "float16")]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    nbytes = 4 * shape[0] * tdtype.itemsize

    def inputs():
        return (
            torch.randn(*shape, device="cuda", dtype=tdtype),
            torch.randn(*shape, device="cuda", dtype=tdtype),
        )

    def pair(xd):
        x, dy = xd
        y = torch.relu(x)
        return torch.ops.aten.threshold_backward(dy, y, 0)

    return rotating(inputs, pair, nbytes)
