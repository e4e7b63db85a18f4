"""Rows that are not whole vectors (issue 31): the split-row default (widest VEC, scalar head
and tail) against the same config at VEC=1 (all an odd row length could run before) and
PyTorch, timed in one process on one GPU; every config verified first by the backend.

    python3 benchmarks/split_rows.py --out $OUT/split_rows.json

Prints a table and writes JSON. Needs a CUDA GPU, PyCUDA and PyTorch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: (operator, shape, dtype): a vocabulary's softmax, odd and prime widths.
CASES = [
    ("softmax", (8192, 50257), "float16"),
    ("softmax", (8192, 50257), "bfloat16"),
    ("softmax", (4096, 3001), "float32"),
    ("softmax", (32768, 1023), "float16"),
    ("layernorm", (8192, 50257), "bfloat16"),
    ("layernorm", (4096, 3001), "float32"),
    ("layernorm", (32768, 1023), "float16"),
]


def torch_fn(operator, shape, dtype):
    import torch

    t = getattr(torch, dtype)
    x = torch.randn(*shape, device="cuda", dtype=t)
    if operator == "softmax":
        return lambda: torch.softmax(x, -1)
    w = torch.randn(shape[1], device="cuda", dtype=t)
    b = torch.randn(shape[1], device="cuda", dtype=t)
    return lambda: torch.nn.functional.layer_norm(x, (shape[1],), w, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="split_rows.json")
    args = ap.parse_args()

    from kato.kernels import get_operator
    from kato.tuner.backends.pycuda import PyCudaBackend

    from benchmarks.operators import torch_time_ms

    rows = []
    for operator, shape, dtype in CASES:
        spec = get_operator(operator)
        split = spec.default_config(shape, dtype)
        scalar = {**split, "VEC": 1}
        row = {"operator": operator, "shape": list(shape), "dtype": dtype, "split": split}
        backend = PyCudaBackend(spec, shape, dtype, seed=0)
        try:
            for name, config in (("split", split), ("vec1", scalar)):
                reason = spec.check(config, shape, dtype)
                result = None if reason else backend.evaluate(config)
                row[f"{name}_ms"] = result.time_ms if result else None
                row[f"{name}_status"] = reason or result.status.value
        finally:
            backend.close()
        row["torch_ms"] = torch_time_ms(torch_fn(operator, shape, dtype))
        gb = spec.bytes_moved(shape, dtype) / 1e9
        row["split_gbs"] = gb / (row["split_ms"] / 1e3) if row["split_ms"] else None
        rows.append(row)
        print(
            f"{operator:10} {'x'.join(map(str, shape)):12} {dtype:9} split {row['split_ms']} ms "
            f"({row['split_status']}), VEC=1 {row['vec1_ms']} ms, torch {row['torch_ms']:.4f} ms",
            flush=True,
        )
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
