"""Run every step of an operator config once on the GPU with arrays of the test's choosing and
read every array back (gpu tests only: reduce_sum, reduce_sum_all and relu use it to check
exact summation trees, the relu mask and repeated launches, which the backend's reference
comparison does not cover)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from kato.kernels.spec import OperatorSpec

_FORMATS = {np.int32: "i", np.uint32: "I", np.int64: "q", np.float32: "f"}


def upload(cuda: Any, args: Sequence[Any]) -> list[Any]:
    """``args`` with every numpy array copied to a fresh device buffer (scalars as they are).
    mem_alloc + memcpy_htod, not to_device: to_device cannot take ml_dtypes' bfloat16 arrays."""
    device = []
    for a in args:
        if isinstance(a, np.ndarray):
            buf = cuda.mem_alloc(max(a.nbytes, 1))
            cuda.memcpy_htod(buf, np.ascontiguousarray(a))
            device.append(buf)
        else:
            device.append(a)
    return device


class StepRunner:
    """One compiled config; :meth:`run` uploads ``args``, launches the steps ``repeat`` times
    and returns the arrays (numpy) as they are after the last launch."""

    def __init__(self, spec: OperatorSpec, config: dict[str, Any], shape, dtype: str):
        import pycuda.autoprimaryctx  # noqa: F401 - a context for this process
        import pycuda.driver as cuda
        from kato.tuner.backends.pycuda import describe_device
        from kato.tuner.nvcc import compile_kernel

        self.cuda = cuda
        self.spec, self.config, self.shape, self.dtype = spec, config, tuple(shape), dtype
        arch = describe_device(0).arch
        source = spec.render(config, self.shape, dtype)
        compiled = compile_kernel(source, spec.kernel_name, arch=arch)
        self.module = cuda.module_from_buffer(compiled.cubin)
        self.steps = spec.steps(config, self.shape, dtype)

    def run(self, args: Sequence[Any], repeat: int = 1) -> list[Any]:
        cuda = self.cuda
        device = upload(cuda, args)
        for _ in range(repeat):
            for step in self.steps:
                indices = step.args if step.args is not None else range(len(args))
                fn = self.module.get_function(step.kernel)
                fmt = "".join(
                    "P" if isinstance(args[i], np.ndarray) else _FORMATS[type(args[i])]
                    for i in indices
                )
                fn.prepare(fmt)
                launch = step.launch
                fn.prepared_call(
                    launch.grid,
                    launch.block,
                    *[device[i] for i in indices],
                    shared_size=launch.shared_bytes,
                )
        cuda.Context.synchronize()
        out = []
        for a, d in zip(args, device, strict=True):
            if isinstance(a, np.ndarray):
                host = np.empty_like(a)
                cuda.memcpy_dtoh(host, d)
                d.free()
                out.append(host)
            else:
                out.append(a)
        return out
