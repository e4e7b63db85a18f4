"""Verify every valid config of an operator on the GPU, compiled in batches (gpu tests only).

The backend compiles one config per nvcc run (~1 s); the row-wise operators have hundreds to
thousands of valid configs per (shape, dtype), most of them sharing a source with others (launch
geometry parameters never reach it). Here the distinct sources are compiled ``BATCH`` to a
translation unit, each variant's kernels and helper namespace renamed
(tests/kernels/compile_harness.py's convention), each batch loaded once, and every config
verified through the backend's own ``verify`` (fresh inputs, poisoned outputs, two runs, every
element against the float64 reference on the device): what these tests accept is what a tuning
job would accept.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kato.kernels.spec import OperatorSpec
from step_runner import upload

BATCH = 32
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)", re.MULTILINE)


def _names(spec: OperatorSpec) -> tuple[str, ...]:
    return tuple(spec.kernel_names or (spec.kernel_name,))


def batch_source(spec: OperatorSpec, sources: Sequence[str]) -> str:
    """One translation unit of ``sources`` (rendered variants of ``spec``); variant i's kernels
    are renamed ``<name>_<i>``."""
    parts = []
    names = _names(spec)
    for i, source in enumerate(sources):
        parts += [f"#define {name} {name}_{i}" for name in names]
        parts += [f"#define KATO_NS kato_ns_{i}", source]
        macros = set(_DEFINE.findall(source)) | set(names) | {"KATO_NS"}
        parts += [f"#undef {name}" for name in sorted(macros)]
    return "\n".join(parts) + "\n"


def _opt_in(backend, calls) -> None:
    """Give each call's function its own dynamic shared memory limit again: configs of one
    source share a function, and load() leaves the limit the last of them asked for."""
    from kato.kernels.limits import needs_shared_opt_in

    attribute = backend.cuda.function_attribute
    for call in calls:
        static = call.fn.get_attribute(attribute.SHARED_SIZE_BYTES)
        if needs_shared_opt_in(static, call.launch.shared_bytes):
            call.fn.set_attribute(attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, call.launch.shared_bytes)


def verify_all(
    spec: OperatorSpec,
    shape: Sequence[int],
    dtype: str,
    *,
    max_configs: int | None = None,
    seed: int = 0,
) -> tuple[int, int, list[tuple[dict[str, Any], str]]]:
    """Verify every valid config of ``spec`` at ``shape``/``dtype`` (device limits included; a
    seeded sample of ``max_configs`` if given, the default config always in). Returns
    ``(configs checked, distinct sources, failures)``, one ``(config, error)`` per failure."""
    from kato.tuner.backends.pycuda import PyCudaBackend
    from kato.tuner.nvcc import CompileError, compile_many

    shape = tuple(shape)
    backend = PyCudaBackend(spec, shape, dtype, repeats=1, warmup=0, seed=seed)
    try:
        valid = [dict(c) for c in backend.space().valid_configs()]
        assert valid, f"no valid config for {spec.name} {shape} {dtype}"
        if max_configs is not None and len(valid) > max_configs:
            valid = random.Random(seed).sample(valid, max_configs)
        default = spec.default_config(shape, dtype)
        if default not in valid:
            valid.insert(0, default)
        by_source: dict[str, list[dict[str, Any]]] = {}
        for config in valid:
            by_source.setdefault(spec.render(config, shape, dtype), []).append(config)
        sources = list(by_source)
        batches = [sources[i : i + BATCH] for i in range(0, len(sources), BATCH)]
        arch = backend.device().arch
        jobs = [(batch_source(spec, b), f"{spec.kernel_name}_0", arch, ()) for b in batches]
        results = compile_many(jobs)
        failures: list[tuple[dict[str, Any], str]] = []
        for batch, compiled in zip(batches, results, strict=True):
            configs = [(i, c) for i, source in enumerate(batch) for c in by_source[source]]
            if isinstance(compiled, CompileError):
                failures += [(c, f"compile error: {compiled.log[-800:]}") for _, c in configs]
                continue
            steps, spans = [], []
            for i, config in configs:
                own = [
                    replace(step, kernel=f"{step.kernel}_{i}")
                    for step in spec.steps(config, shape, dtype)
                ]
                spans.append((len(steps), len(steps) + len(own)))
                steps += own
            calls = backend.load(compiled, steps)  # one module load per batch
            for (_, config), (lo, hi) in zip(configs, spans, strict=True):
                _opt_in(backend, calls[lo:hi])
                error = backend.verify(calls[lo:hi])
                if error:
                    failures.append((config, error))
        return len(valid), len(sources), failures
    finally:
        backend.close()


def run_offset(
    spec: OperatorSpec,
    config: dict[str, Any],
    shape: Sequence[int],
    dtype: str,
    row_arrays: Sequence[int],
    offset_elements: int,
    seed: int = 0,
) -> list[str]:
    """Run one config once with the arrays ``row_arrays`` (indices into the problem's args) placed
    ``offset_elements`` elements past a 256-byte boundary (as a view into a larger tensor would
    be), every other array aligned; compare every output with its reference. Returns one line per
    output outside its tolerance."""
    import numpy as np
    import pycuda.autoprimaryctx  # noqa: F401 - a context for this process
    import pycuda.driver as cuda
    from kato.kernels.limits import needs_shared_opt_in
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.nvcc import compile_kernel

    shape = tuple(shape)
    arch = describe_device(0).arch
    problem = spec.make_problem(shape, dtype, np.random.default_rng(seed))
    compiled = compile_kernel(spec.render(config, shape, dtype), spec.kernel_name, arch=arch)
    module = cuda.module_from_buffer(compiled.cubin)
    keep, args = [], []
    for index, a in enumerate(problem.args):
        if not isinstance(a, np.ndarray):
            args.append(a)
            continue
        shift = offset_elements * a.itemsize if index in row_arrays else 0
        buf = cuda.mem_alloc(a.nbytes + 256)
        keep.append(buf)
        cuda.memcpy_htod(int(buf) + shift, np.ascontiguousarray(a))
        args.append(np.uintp(int(buf) + shift))
    for step in spec.steps(config, shape, dtype):
        fn = module.get_function(step.kernel)
        launch = step.launch
        static = fn.get_attribute(cuda.function_attribute.SHARED_SIZE_BYTES)
        if needs_shared_opt_in(static, launch.shared_bytes):
            fn.set_attribute(
                cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, launch.shared_bytes
            )
        indices = step.args if step.args is not None else range(len(args))
        fn(*[args[i] for i in indices], block=launch.block, grid=launch.grid,
           shared=launch.shared_bytes)  # fmt: skip
    cuda.Context.synchronize()
    tolerances = problem.tolerances or [spec.tolerance(dtype)] * len(problem.outputs)
    bad = []
    for out, ref, (atol, rtol) in zip(problem.outputs, problem.references, tolerances, strict=True):
        host = np.empty_like(problem.args[out])
        cuda.memcpy_dtoh(host, int(args[out]))
        got = host.astype(np.float64)
        want = ref.astype(np.float32).astype(np.float64)
        ok = (got == want) | (np.isfinite(got) & (np.abs(got - want) <= atol + rtol * np.abs(want)))
        if not ok.all():
            bad.append(f"output {out}: {int((~ok).sum())} of {ok.size} outside tolerance")
    return bad


def run_arrays(spec: OperatorSpec, config: dict[str, Any], shape: Sequence[int], dtype: str,
               args: Sequence[Any]) -> list[Any]:  # fmt: skip
    """Run ``config``'s steps once on device copies of ``args`` (a problem's argument list,
    arrays possibly taken from another operator's outputs); returns the arguments with every
    array copied back from the device, so one operator's outputs can feed the next."""
    import numpy as np
    import pycuda.autoprimaryctx  # noqa: F401 - a context for this process
    import pycuda.driver as cuda
    from kato.kernels.limits import needs_shared_opt_in
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.nvcc import compile_kernel

    shape = tuple(shape)
    source = spec.render(config, shape, dtype)
    compiled = compile_kernel(source, spec.kernel_name, arch=describe_device(0).arch)
    module = cuda.module_from_buffer(compiled.cubin)
    device = upload(cuda, args)
    for step in spec.steps(config, shape, dtype):
        fn = module.get_function(step.kernel)
        launch = step.launch
        static = fn.get_attribute(cuda.function_attribute.SHARED_SIZE_BYTES)
        if needs_shared_opt_in(static, launch.shared_bytes):
            fn.set_attribute(
                cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, launch.shared_bytes
            )
        indices = step.args if step.args is not None else range(len(device))
        fn(*[device[i] for i in indices], block=launch.block, grid=launch.grid,
           shared=launch.shared_bytes)  # fmt: skip
    cuda.Context.synchronize()
    out = []
    for a, d in zip(args, device, strict=True):
        if isinstance(a, np.ndarray):
            host = np.empty_like(a)
            cuda.memcpy_dtoh(host, d)
            out.append(host)
        else:
            out.append(a)
    return out
