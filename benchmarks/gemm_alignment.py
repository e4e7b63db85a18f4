"""cuBLAS (torch.matmul) on a dimension that is not a multiple of 8, three ways side by side:
contiguous operands (an odd leading dimension), the same logical shape as a view of a buffer
whose rows are padded to a multiple of 8 (aligned leading dimension), and the fully padded
problem. The shapes are a language-model head's three GEMMs (logits = x W^T, dX = dlogits W,
dW = dlogits^T x) at a vocabulary that is not a multiple of 8.

    python benchmarks/gemm_alignment.py --tokens 8192 --width 768 --vocab 50257 --out gemm.json
"""

from __future__ import annotations

import argparse
import json

import torch


def median_ms(fn, repeats=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def padded(rows, cols, ld, dtype):
    """A (rows, cols) view of a (rows, ld) buffer: rows start 16-byte aligned."""
    return torch.randn(rows, ld, device="cuda", dtype=dtype)[:, :cols]


def measure(name, t, c, v):
    """The three GEMMs of a head at vocabulary v, each three ways, in dtype ``name``."""
    dt = getattr(torch, name)
    vp = -(-v // 8) * 8
    x = torch.randn(t, c, device="cuda", dtype=dt)
    w = torch.randn(v, c, device="cuda", dtype=dt)
    wp = torch.randn(vp, c, device="cuda", dtype=dt)
    g = torch.randn(t, v, device="cuda", dtype=dt)
    gv = padded(t, v, vp, dt)
    gp = torch.randn(t, vp, device="cuda", dtype=dt)
    cases = {
        "logits = x W^T": {
            "contiguous": lambda: x @ w.t(),
            "padded view": lambda: (x @ wp.t())[:, :v],
            "padded": lambda: x @ wp.t(),
        },
        "dX = dlogits W": {
            "contiguous": lambda: g @ w,
            "padded view": lambda: gv @ w,
            "padded": lambda: gp @ wp,
        },
        "dW = dlogits^T x": {
            "contiguous": lambda: g.t() @ x,
            "padded view": lambda: gv.t() @ x,
            "padded": lambda: gp.t() @ x,
        },
    }
    flops = 2 * t * v * c
    rows = []
    for case, ways in cases.items():
        row = {"dtype": name, "case": case, "tokens": t, "width": c, "vocab": v}
        for way, fn in ways.items():
            ms = median_ms(fn)
            row[way] = {"ms": ms, "tflops": flops / ms / 1e9}
        rows.append(row)
        print(f"{name:9} {case:18} " + "  ".join(
            f"{way} {row[way]['ms']:.3f} ms ({row[way]['tflops']:.0f} TF/s)" for way in ways
        ), flush=True)  # fmt: skip
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--out", default="gemm_alignment.json")
    args = ap.parse_args()
    t, c, v = args.tokens, args.width, args.vocab
    rows = [row for name in args.dtypes.split(",") for row in measure(name, t, c, v)]
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
