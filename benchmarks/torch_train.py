"""Training steps with Kato's kernels vs PyTorch eager and torch.compile, side by side on one GPU.

For each model and dtype the same step (forward, loss, backward: every parameter's gradient) runs
four ways on the same weights and inputs:

- ``eager``: plain PyTorch;
- ``compile``: ``torch.compile(model)`` (Inductor);
- ``kato``: the model as ``kato_torch.fuse(kato_torch.patch(model))`` makes it: LayerNorm,
  Linear, ReLU, CrossEntropyLoss, BatchNorm2d, RMSNorm, Softmax swapped for Kato's drop-ins,
  then every ``BatchNorm2d -> ReLU`` and ``BatchNorm2d -> add -> ReLU`` of a module's forward
  rewritten into Kato's fused ``batch_norm_relu`` (batchnorm_relu / batchnorm_add_relu and their
  backwards), eager;
- ``kato+compile``: the patched model compiled (Kato's custom ops stay in the graph);
- with ``--cudagraphs`` also both compiled with ``mode="reduce-overhead"`` (``compile_cg_ms``,
  ``kato_compile_cg_ms``): CUDA graphs replay the step without the host, so these two compare
  the GPU work alone where ``compile_cg_skips`` and ``kato_compile_cg_skips`` are 0 (graphs
  Inductor declined to capture, which then run uncaptured).

Loss and every gradient are checked against eager PyTorch first (relative error of each
gradient's norm, printed); for a 16-bit step both Kato's and eager PyTorch's gradients are also
compared with a float32 copy of the model (``grad_err_*_vs_f32``, and the parameter where
Kato's error exceeds eager's most). Step times are medians of CUDA-event timed steps.

Models: ``mlp`` (three Linear, two LayerNorm + ReLU, cross-entropy over 1000 classes);
``gpt2`` (GPT-2 small: 12 layers of width 768, 12 heads, sequence 1024, vocabulary 50257;
attention through ``scaled_dot_product_attention``, GELU through torch, the rest Kato's);
``resnet`` (a ResNet-style network of 3x3 convolutions (cuDNN) with BatchNorm2d and ReLU, a
Linear head over 1000 classes).

Configs come from a results database (``--db``): with ``--tune B`` every (operator, shape, dtype)
the Kato step runs (captured with ``kato_torch.record()``) that the database holds no winner for is
first tuned there by a ``kato worker`` (budget B; each job also times PyTorch's own op for the
never-slower policy). ``--policy auto`` (the default) runs Kato's kernel only where its stored
winner beat PyTorch's op; ``--policy kato`` runs Kato's kernels everywhere.

    python benchmarks/torch_train.py --db sqlite:///kato.db --tune 20 --out torch_train.json
    python benchmarks/torch_train.py --models mlp --dtypes float32 --no-compile   # quick

Needs a CUDA GPU, PyTorch and nvcc (and PyCUDA for ``--tune``).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402 - Inductor's cudagraph skips

import kato_torch  # noqa: E402
from benchmarks.torch_mlp import time_ms  # noqa: E402 - median of CUDA-event timed calls

# --- models -----------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, dims=(1024, 2048, 2048, 1000)):
        super().__init__()
        d0, d1, d2, d3 = dims
        self.body = nn.Sequential(
            nn.Linear(d0, d1), nn.LayerNorm(d1), nn.ReLU(),
            nn.Linear(d1, d2), nn.LayerNorm(d2), nn.ReLU(),
            nn.Linear(d2, d3),
        )  # fmt: skip
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        return self.loss(self.body(x), labels)


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU(approximate="tanh")
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers=12, width=768, heads=12, vocab=50257, seq=1024):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, tokens, labels):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return self.loss(logits.view(-1, logits.shape[-1]), labels.view(-1))


class ResBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.skip = None
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + (x if self.skip is None else self.skip(x)))


class ResNet(nn.Module):
    """ResNet-18's layout (2 blocks per stage, 64-512 channels) on 224x224 inputs."""

    def __init__(self, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))  # fmt: skip
        stages, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages += [ResBlock(cin, cout, stride), ResBlock(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(512, classes)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        h = self.stages(self.stem(x)).mean(dim=(2, 3))
        return self.loss(self.fc(h), labels)


def build(name, dtype, batch):
    """(model, inputs) seeded; batch None: the model's default."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.manual_seed(0)
    if name == "mlp":
        batch = batch or 4096
        model = MLP()
        inputs = (torch.randn(batch, 1024, device="cuda", generator=gen).to(dtype),
                  torch.randint(0, 1000, (batch,), device="cuda", generator=gen))  # fmt: skip
    elif name == "gpt2":
        batch = batch or 8
        model = GPT()
        tokens = torch.randint(0, 50257, (batch, 1025), device="cuda", generator=gen)
        inputs = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    elif name == "resnet":
        batch = batch or 64
        model = ResNet()
        inputs = (torch.randn(batch, 3, 224, 224, device="cuda", generator=gen).to(dtype),
                  torch.randint(0, 1000, (batch,), device="cuda", generator=gen))  # fmt: skip
    else:
        raise SystemExit(f"unknown model {name!r}: mlp, gpt2 or resnet")
    return model.to(device="cuda", dtype=dtype), inputs, batch


# --- steps, checks, timing --------------------------------------------------------------------


def step(model, inputs):
    loss = model(*inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    return loss, torch.autograd.grad(loss, params)


def grad_errors(grads, ref):
    """Relative error of each gradient (norm of the difference over the reference's)."""
    errors = []
    for g, r in zip(grads, ref, strict=True):
        r32 = r.float()
        errors.append(float((g.float() - r32).norm() / r32.norm().clamp_min(1e-30)))
    return errors


def grad_error(grads, ref):
    """Largest relative error of a gradient (norm of the difference over the reference's)."""
    return max(grad_errors(grads, ref), default=0.0)


def float32_reference(base, inputs):
    """The step's gradients in float32 (a float32 copy of the model and its floating inputs):
    the yardstick of a 16-bit step, where eager PyTorch's own gradients carry its roundings."""
    model = copy.deepcopy(base).float()
    inputs32 = tuple(i.float() if i.is_floating_point() else i for i in inputs)
    _, grads = step(model, inputs32)
    del model
    return grads


# --- configs from the results database --------------------------------------------------------


class DbLookups:
    """What the service would answer for this GPU, read from the results database directly
    (:class:`service.lookup.Lookups`, the service's own selection under its settings): the
    config, its source and its stored speedups over PyTorch's op, eager and compiled by
    torch.compile (the policy's bar inside a compiled graph)."""

    def __init__(self, db_url):
        from kato.db.session import init_db, session_factory
        from kato.service.settings import Settings

        self.sessions = session_factory(init_db(db_url))
        self.settings = Settings(db_url=db_url)

    def lookup(self, operator, shape, dtype, gpu=None):
        from kato.kernels import get_operator
        from kato.service.lookup import Lookups

        from kato.shared.gpus import normalize_gpu_name

        model = gpu or normalize_gpu_name(torch.cuda.get_device_name())
        with self.sessions() as s:
            lookups = Lookups(
                s,
                max_distance=self.settings.nearest_max_distance,
                min_gain=self.settings.nearest_min_gain,
            )
            answer = lookups.answer(get_operator(operator), shape, dtype, model)
        row = answer.row
        return {"config": answer.config, "source": answer.source, "speedup": answer.speedup,
                "time_ms": getattr(row, "time_ms", None),
                "framework_ms": getattr(row, "framework_ms", None),
                "compiled_speedup": answer.compiled_speedup,
                "compiled_ms": getattr(row, "compiled_ms", None)}  # fmt: skip


def capture(name, dtype, batch):
    """The (operator, shape, dtype) keys of one Kato step of this model (PyTorch runs it:
    capture needs no compile)."""
    base, inputs, _ = build(name, dtype, batch)
    model = kato_torch.fuse(kato_torch.patch(base))
    kato_torch.configure(client=None, policy="torch")
    with kato_torch.record() as rec:
        step(model, inputs)
    del model, inputs
    torch.cuda.empty_cache()
    return rec.keys


def tune_missing(keys, db_url, budget, gpu_model, timeout_s=None):
    """Queue a job for every key without an exact winner (in the order given) and run one
    worker until they are done (or ``timeout_s`` passes: the rest stay queued)."""
    from kato.db import queries
    from kato.db.session import init_db, session_factory
    from kato.kernels import get_operator

    lookups = DbLookups(db_url)
    todo = [k for k in keys if lookups.lookup(k.operator, k.shape, k.dtype)["source"] != "exact"]
    if not todo:
        return 0, 0.0
    sessions = session_factory(init_db(db_url))
    with sessions() as s:
        fields = [dict(operator=k.operator, operator_version=get_operator(k.operator).version,
                       shape=list(k.shape), dtype=k.dtype, gpu_model=gpu_model,
                       budget_configs=budget) for k in todo]  # fmt: skip
        queries.create_jobs(s, fields)
    started = time.perf_counter()
    worker = subprocess.Popen(
        [sys.executable, "-c", "from kato.service.cli import main; main()", "worker", "--db",
         db_url, "--max-jobs", str(len(todo))],
    )  # fmt: skip
    try:
        worker.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # SIGTERM: the worker ends its trial in flight and gives its job back (a SIGKILL left
        # the job leased and its measuring child writing into a closed pipe).
        worker.terminate()
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        print(f"tuning stopped after {timeout_s} s", flush=True)
    return len(todo), time.perf_counter() - started


# --- main -------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,gpt2,resnet")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batch", type=int, help="batch size (default: per model)")
    ap.add_argument("--db", help="results database (default: none: Kato's default configs)")
    ap.add_argument("--tune", type=int, default=0, help="tune untuned keys at this budget first")
    ap.add_argument("--policy", default="auto", choices=["auto", "kato"])
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    ap.add_argument(
        "--cudagraphs",
        action="store_true",
        help="also both compiled models with mode='reduce-overhead' (CUDA graphs: no host cost)",
    )
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--tune-only",
        action="store_true",
        help="capture every model's keys, tune the missing ones, time nothing",
    )
    ap.add_argument("--tune-minutes", type=float, help="with --tune-only: stop tuning after this")
    ap.add_argument("--out", default="torch_train.json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # Kato's float32 GEMM is exact float32 too
    torch.backends.cudnn.allow_tf32 = False
    from kato.shared.gpus import normalize_gpu_name

    gpu_model = normalize_gpu_name(torch.cuda.get_device_name())
    client = DbLookups(args.db) if args.db else None
    if args.tune_only:
        keys = []
        for name in args.models.split(","):
            for dtype_name in args.dtypes.split(","):
                keys += [k for k in capture(name, getattr(torch, dtype_name), args.batch)
                         if k not in keys]  # fmt: skip
        print(f"{len(keys)} keys", flush=True)
        timeout = args.tune_minutes * 60 if args.tune_minutes else None
        queued, seconds = tune_missing(keys, args.db, args.tune, gpu_model, timeout)
        print(f"tuned {queued} keys in {seconds:.0f} s", flush=True)
        return
    rows = []
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            base, inputs, batch = build(name, dtype, args.batch)
            kato_model = kato_torch.fuse(kato_torch.patch(copy.deepcopy(base)))
            # Capture every key of the step (PyTorch runs it: no compiles), tune what is missing.
            kato_torch.configure(client=client, policy="torch")
            with kato_torch.record() as rec:
                step(kato_model, inputs)
            tuned, tune_s = 0, 0.0
            if args.tune and args.db:
                tuned, tune_s = tune_missing(rec.keys, args.db, args.tune, gpu_model)
            kato_torch.configure(client=DbLookups(args.db) if args.db else None,
                                 policy=args.policy)  # fmt: skip
            prepare_s = time.perf_counter()
            kato_torch.prepare(rec.keys, inputs[0].device.index or 0)  # compiles in parallel
            prepare_s = time.perf_counter() - prepare_s
            loss_ref, grads_ref = step(base, inputs)
            loss, grads = step(kato_model, inputs)
            row = {
                "model": name, "dtype": dtype_name, "batch": batch,
                "keys": len(rec.keys), "tuned_now": tuned, "tune_s": round(tune_s, 1),
                "prepare_s": round(prepare_s, 1),
                "kato_keys": sum(kato_torch.policy.decide(k.operator, k.shape, k.dtype, "cuda")
                                 for k in rec.keys),
                # Kato's kernel while the GPU lags the host (kato_torch.policy.WHEN_BUSY)
                "when_busy_keys": sum(
                    kato_torch.policy.verdict(k.operator, k.shape, k.dtype, "cuda")
                    == kato_torch.policy.WHEN_BUSY for k in rec.keys),
                "loss_torch": float(loss_ref), "loss_kato": float(loss),
                "max_rel_grad_err": grad_error(grads, grads_ref),
            }  # fmt: skip
            if dtype != torch.float32:
                # Both 16-bit steps against float32: Kato's gradients are as good as eager's
                # when their errors are alike (they differ from each other by about both).
                grads32 = float32_reference(base, inputs)
                names = [n for n, p in base.named_parameters() if p.requires_grad]
                ours, theirs = grad_errors(grads, grads32), grad_errors(grads_ref, grads32)
                worst = max(range(len(names)), key=lambda i: ours[i] - theirs[i])
                row.update(grad_err_kato_vs_f32=max(ours), grad_err_eager_vs_f32=max(theirs),
                           worst_param=names[worst], worst_param_kato_vs_f32=ours[worst],
                           worst_param_eager_vs_f32=theirs[worst])  # fmt: skip
                del grads32
            models = {"eager_ms": base, "kato_ms": kato_model}
            if not args.no_compile:
                models.update(compile_ms=torch.compile(base),
                              kato_compile_ms=torch.compile(kato_model))  # fmt: skip
            if args.cudagraphs:
                # Replayed graphs cost the host nothing per kernel: what is left is each
                # side's GPU time, Kato's kernels against Inductor's.
                models.update(
                    compile_cg_ms=torch.compile(base, mode="reduce-overhead"),
                    kato_compile_cg_ms=torch.compile(kato_model, mode="reduce-overhead"),
                )
            for column, model in models.items():
                skips = counters["inductor"]["cudagraph_skips"]
                row[column] = time_ms(lambda m=model, i=inputs: step(m, i), args.repeats)
                if column.endswith("_cg_ms"):
                    # A graph Inductor would not capture (a mutated input, a CPU tensor, an op
                    # it cannot replay) runs uncaptured: the column then times the plain
                    # compiled step, which its skips (0 where every graph was captured) say.
                    skipped = counters["inductor"]["cudagraph_skips"] - skips
                    row[column.replace("_ms", "_skips")] = skipped
            row["kato_vs_eager"] = row["eager_ms"] / row["kato_ms"]
            if "compile_ms" in row:
                row["kato_compile_vs_compile"] = row["compile_ms"] / row["kato_compile_ms"]
                row["best_kato_vs_compile"] = row["compile_ms"] / min(
                    row["kato_ms"], row["kato_compile_ms"]
                )
            if "compile_cg_ms" in row:
                row["kato_vs_compile_cudagraphs"] = row["compile_cg_ms"] / row["kato_compile_cg_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del base, kato_model, models
            torch.cuda.empty_cache()
    head = (f"{'model':7} {'dtype':9} {'keys':>4} {'kato':>4} {'grad err':>9} {'eager':>8} "
            f"{'compile':>8} {'kato':>8} {'kato+c':>8} {'x eager':>7} "
            f"{'x compile':>9}")  # fmt: skip
    print(head)
    for r in rows:
        print(
            f"{r['model']:7} {r['dtype']:9} {r['keys']:4d} {r['kato_keys']:4d} "
            f"{r['max_rel_grad_err']:9.2e} {r['eager_ms']:8.2f} {r.get('compile_ms', 0):8.2f} "
            f"{r['kato_ms']:8.2f} {r.get('kato_compile_ms', 0):8.2f} {r['kato_vs_eager']:7.2f} "
            f"{r.get('kato_compile_vs_compile', 0):9.2f}"
        )
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "policy": args.policy, "rows": rows}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
