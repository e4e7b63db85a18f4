"""Host cost per call of kato_torch's layers, side by side with PyTorch's own op: where the CPU
time of a launch-bound step goes (microseconds per call, a small layer norm so the GPU is never
the limit).

    python benchmarks/kato_torch_overhead.py --out overhead.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ctypes  # noqa: E402

import torch  # noqa: E402
from kato.tuner import cuda_driver  # noqa: E402

import kato_torch  # noqa: E402
from kato_torch import _driver, ops  # noqa: E402
from kato_torch._kernels import bind  # noqa: E402


def per_call_us(fn, calls):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def time_parts(step, calls):
    """Inclusive host time per step of the functions a Kato layer norm passes through, on
    whichever thread runs them (the backward runs on autograd's device thread, where cProfile
    does not look): each is wrapped in place for the measurement, then restored."""
    from kato_torch import _kernels, ops

    spent: dict[str, float] = {}
    names = ["layer_norm", "_layer_norm", "_layer_norm_backward", "_layer_norm_grads",
             "_launch_layer_norm", "_use", "_run", "bind", "_norm_inputs"]  # fmt: skip
    originals = {}

    def timed(name, fn):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

        return call

    for name in names:
        originals[name] = getattr(ops, name)
        setattr(ops, name, timed(f"ops.{name}", originals[name]))
    run = _kernels.BoundOperator.run
    _kernels.BoundOperator.run = timed("BoundOperator.run", run)
    try:
        for _ in range(50):
            step()
        torch.cuda.synchronize()
        spent.clear()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        spent["whole step"] = time.perf_counter() - start
        torch.cuda.synchronize()
    finally:
        for name, fn in originals.items():
            setattr(ops, name, fn)
        _kernels.BoundOperator.run = run
    return {name: seconds / calls * 1e6 for name, seconds in sorted(spent.items())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=768)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default="kato_torch_overhead.json")
    args = ap.parse_args()
    rows, cols = args.rows, args.cols
    kato_torch.configure(client=None, policy="kato")
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(cols, device="cuda", dtype=torch.bfloat16)
    b = torch.zeros(cols, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    y = torch.empty_like(x)
    mean = torch.empty(rows, device="cuda")
    rstd = torch.empty(rows, device="cuda")
    bound = bind("layernorm", (rows, cols), "bfloat16", 0)
    largs = [x, w, b, y, mean, rstd, rows, cols, 1e-5]
    stream = torch.cuda.current_stream().cuda_stream
    call = bound.calls[0]
    values = [_driver.ctypes.c_void_p(t.data_ptr()) for t in (x, w, b, y, mean, rstd)]
    values += [_driver.ctypes.c_int(rows), _driver.ctypes.c_int(cols),
               _driver.ctypes.c_float(1e-5)]  # fmt: skip
    dy = torch.randn_like(x)

    def forward_backward_kato():
        out = kato_torch.layer_norm(xg, (cols,), w, b)
        torch.autograd.grad(out, (xg,), dy)

    def forward_backward_torch():
        out = torch.nn.functional.layer_norm(xg, (cols,), w, b)
        torch.autograd.grad(out, (xg,), dy)

    class Identity(torch.autograd.Function):  # the floor: any Python backward on CUDA tensors
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def forward_backward_identity():
        torch.autograd.grad(Identity.apply(xg), (xg,), dy)

    class TorchLayerNorm(torch.autograd.Function):  # PyTorch's kernels behind a Python node
        @staticmethod
        def forward(ctx, t, weight, bias):
            out, mu, rs = torch.native_layer_norm(t, (cols,), weight, bias, 1e-5)
            ctx.save_for_backward(t, weight, mu, rs)
            return out

        @staticmethod
        def backward(ctx, grad):
            t, weight, mu, rs = ctx.saved_tensors
            return torch.ops.aten.native_layer_norm_backward(
                grad, t, (cols,), mu, rs, weight, weight, (True, True, True)
            )

    def forward_backward_python_torch():
        torch.autograd.grad(TorchLayerNorm.apply(xg, w, b), (xg,), dy)

    _, saved_mean, saved_rstd = ops._layer_norm(x, w, b, 1e-5)

    def ctx_push_pop():
        with _driver.on_device(0):
            pass

    cases = {
        "torch F.layer_norm": lambda: torch.nn.functional.layer_norm(x, (cols,), w, b),
        "torch.empty_like x3": lambda: (
            torch.empty_like(x),
            torch.empty(rows, device="cuda"),
            torch.empty(rows, device="cuda"),
        ),  # fmt: skip
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(0).cuda_stream,
        "on_device push/pop": ctx_push_pop,
        "_driver.launch": lambda: _driver.launch(
            call.func, call.launch.grid, call.launch.block, call.launch.shared_bytes, stream, values
        ),
        "BoundOperator.run": lambda: bound.run(largs),
        "torch.ops.kato.layer_norm": lambda: torch.ops.kato.layer_norm(x, w, b, 1e-5),
        "kato_torch.layer_norm (no grad)": lambda: kato_torch.layer_norm(x, (cols,), w, b),
        "kato_torch.layer_norm fwd+bwd": forward_backward_kato,
        "torch layer_norm fwd+bwd": forward_backward_torch,
        "Python Function fwd+bwd (floor)": forward_backward_identity,
        "Python Function(torch LN) fwd+bwd": forward_backward_python_torch,
        "Kato backward alone, main thread": lambda: ops._layer_norm_backward(
            x, w, saved_mean, saved_rstd, dy
        ),
    }
    results = {}
    for name, fn in cases.items():
        results[name] = per_call_us(fn, args.calls)
        print(f"{name:34} {results[name]:8.1f} us/call", flush=True)
    # The same Kato calls with the context queries' GIL released around each ctypes call (a
    # CDLL handle, as before cuda_driver.quick_library), and with the launch keeping it (a
    # PyDLL for cuLaunchKernel too): what the GIL costs a call, both ways.
    quick, plain = cuda_driver.quick_library(), cuda_driver.library()
    variants = {
        "context queries release the GIL": ("_quick", ctypes.CDLL("libcuda.so.1")),
        "launch keeps the GIL too": ("_lib", ctypes.PyDLL("libcuda.so.1")),
    }
    for label, (slot, lib) in variants.items():
        lib.cuLaunchKernel.argtypes = plain.cuLaunchKernel.argtypes
        lib.cuLaunchKernel.restype = ctypes.c_int
        setattr(cuda_driver, slot, lib)
        try:
            for name in ("kato_torch.layer_norm (no grad)", "kato_torch.layer_norm fwd+bwd"):
                key = f"{name}, {label}"
                results[key] = per_call_us(cases[name], args.calls)
                print(f"{key:34} {results[key]:8.1f} us/call", flush=True)
        finally:
            cuda_driver._quick, cuda_driver._lib = quick, plain
    breakdown = time_parts(forward_backward_kato, args.calls)
    print("\nwhere a Kato forward + backward's host time goes (inclusive us per step, any thread):")
    for name, us in breakdown.items():
        print(f"  {name:40} {us:8.1f}")
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows, "cols": cols, "us_per_call": results,
                   "breakdown_us_per_step": breakdown}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
