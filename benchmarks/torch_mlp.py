"""A small MLP's training step with Kato's kernels vs plain PyTorch, side by side on one GPU.

The model: three matmuls, two layer norms and two ReLUs, then softmax cross-entropy; one step
is forward + backward (gradients of every parameter). Both sides run the same step on the same
inputs; the script checks that loss and gradients agree within the dtype's tolerance, then
times each side (CUDA events, median of repeats).

    python benchmarks/torch_mlp.py [--db sqlite:///kato.db] [--out torch_mlp.json]

With ``--db``, configs come from that results database (what the service would serve for this
GPU); without it, each operator's default config runs. Needs a CUDA GPU, PyTorch and nvcc.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kato_torch  # noqa: E402

KATO_OPS = {
    "matmul": kato_torch.matmul,
    "layernorm": kato_torch.layernorm,
    "relu": kato_torch.relu,
    "softmax": kato_torch.softmax,
}
TORCH_OPS = {
    "matmul": torch.matmul,
    "layernorm": lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
    "relu": torch.relu,
    "softmax": lambda x: torch.softmax(x, -1),
}


def mlp_problem(dtype, batch=512, dims=(1024, 2048, 2048, 1000), seed=0):
    """Inputs, labels and the 7 parameters (3 weights, 2 x (gain, bias)), seeded."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    d0, d1, d2, d3 = dims

    def p(*shape, scale):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    params = [
        p(d0, d1, scale=d0**-0.5),
        1 + p(d1, scale=0.1),
        p(d1, scale=0.1),
        p(d1, d2, scale=d1**-0.5),
        1 + p(d2, scale=0.1),
        p(d2, scale=0.1),
        p(d2, d3, scale=d2**-0.5),
    ]
    params = [t.requires_grad_() for t in params]
    x = p(batch, d0, scale=1.0)
    labels = torch.randint(0, d3, (batch,), device="cuda", generator=gen)
    return x, labels, params


def mlp_step(x, labels, params, ops):
    """Forward + backward of one step: (loss, gradients of every parameter)."""
    w1, g1, b1, w2, g2, b2, w3 = params
    h = ops["relu"](ops["layernorm"](ops["matmul"](x, w1), g1, b1))
    h = ops["relu"](ops["layernorm"](ops["matmul"](h, w2), g2, b2))
    probs = ops["softmax"](ops["matmul"](h, w3))
    loss = -torch.log(probs.float().gather(1, labels[:, None]) + 1e-12).mean()
    grads = torch.autograd.grad(loss, params)
    return loss, grads


class DbConfigs:
    """A config source reading the results database directly (what the service would serve)."""

    def __init__(self, db_url: str) -> None:
        from kato.db.session import init_db, session_factory

        self.sessions = session_factory(init_db(db_url))

    def config(self, operator, shape, dtype, gpu=None):
        from kato.kernels import get_operator
        from kato.service.lookup import Lookups
        from kato.service.settings import Settings

        from kato.shared.gpus import normalize_gpu_name

        settings = Settings()
        model = normalize_gpu_name(torch.cuda.get_device_name())
        with self.sessions() as s:
            lookups = Lookups(
                s,
                max_distance=settings.nearest_max_distance,
                min_gain=settings.nearest_min_gain,
            )
            return lookups.answer(get_operator(operator), shape, dtype, model).config


def time_ms(fn, repeats=30, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="results database to take configs from (default: defaults)")
    ap.add_argument("--out", default="torch_mlp.json")
    ap.add_argument("--batch", type=int, default=4096)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # Kato's fp32 matmul is exact fp32 too
    kato_torch.configure(client=DbConfigs(args.db) if args.db else None, policy="kato")

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x, labels, params = mlp_problem(dtype, batch=args.batch)
        loss, grads = mlp_step(x, labels, params, KATO_OPS)
        loss_ref, grads_ref = mlp_step(x, labels, params, TORCH_OPS)
        grad_err = max(
            float((g.float() - r.float()).norm() / r.float().norm())
            for g, r in zip(grads, grads_ref, strict=True)
        )
        kato_ms = time_ms(lambda a=(x, labels, params): mlp_step(*a, KATO_OPS))
        torch_ms = time_ms(lambda a=(x, labels, params): mlp_step(*a, TORCH_OPS))
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "batch": args.batch,
                "loss_kato": float(loss),
                "loss_torch": float(loss_ref),
                "max_rel_grad_err": grad_err,
                "kato_ms": kato_ms,
                "torch_ms": torch_ms,
                "speedup": torch_ms / kato_ms,
            }
        )
    print(
        f"{'dtype':9} {'batch':>6} {'loss Kato':>10} {'loss torch':>10} {'grad err':>9} "
        f"{'Kato ms':>8} {'torch ms':>8} {'speedup':>7}"
    )
    for r in rows:
        print(
            f"{r['dtype']:9} {r['batch']:6d} {r['loss_kato']:10.5f} {r['loss_torch']:10.5f} "
            f"{r['max_rel_grad_err']:9.2e} {r['kato_ms']:8.3f} {r['torch_ms']:8.3f} "
            f"{r['speedup']:7.2f}"
        )
    report = {"device": torch.cuda.get_device_name(), "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
