"""The operators a block dispatches, for kato_torch's CPU tests (which path a call took)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):
    """The operators a block dispatches (custom ops included), in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
