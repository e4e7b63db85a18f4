"""The never-slower policy, shape capture and batch submission (kato_torch.policy), and the
module drop-ins with kato_torch.patch."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from op_log import OpLog
from torch._subclasses.fake_tensor import FakeTensorMode

import kato_torch
from kato_torch import policy


@dataclass
class Answer:
    config: dict
    source: str
    speedup: float | None


class FakeClient:
    """Answers from a table keyed by (operator, shape); records lookups and submitted batches."""

    def __init__(self, answers):
        self.answers = answers
        self.asked = []
        self.batches = []

    def lookup(self, operator, shape, dtype, gpu=None):
        self.asked.append((operator, tuple(shape), dtype, gpu))
        return self.answers.get((operator, tuple(shape)), Answer({}, "default", None))

    def submit_batch(self, jobs, gpu=None, budget=None, **options):
        self.batches.append((jobs, gpu, budget, options))
        return [{"id": f"job{i}", **job} for i, job in enumerate(jobs)]


def test_auto_runs_kato_only_where_a_tuned_winner_beat_pytorch():
    client = FakeClient({
        ("softmax", (8, 4096)): Answer({}, "exact", 1.4),
        ("softmax", (8, 1024)): Answer({}, "exact", 0.9),
        ("softmax", (8, 3072)): Answer({}, "exact", 1.02),  # within the noise: not enough
        ("softmax", (8, 2048)): Answer({}, "exact", None),  # a service without framework times
        ("softmax", (8, 512)): Answer({}, "nearest", 3.0),  # another shape's figures
    })  # fmt: skip
    kato_torch.configure(client=client, gpu="H200")
    decide = policy.decide
    assert decide("softmax", (8, 4096), "float16", "cuda") is True
    assert decide("softmax", (8, 1024), "float16", "cuda") is False
    assert decide("softmax", (8, 3072), "float16", "cuda") is False
    assert decide("softmax", (8, 2048), "float16", "cuda") is False
    assert decide("softmax", (8, 512), "float16", "cuda") is False
    assert decide("softmax", (8, 256), "float16", "cuda") is False  # untuned: default answer
    assert decide("softmax", (8, 4096), "float16", "cpu") is False
    assert ("softmax", (8, 4096), "float16", "H200") in client.asked
    asked = len(client.asked)
    assert decide("softmax", (8, 4096), "float16", "cuda") is True
    assert len(client.asked) == asked  # decisions are cached


def test_auto_in_a_compiled_graph_asks_a_larger_speedup():
    """Inside torch.compile a Kato op blocks Inductor's fusions: a winner 1.4x faster than
    PyTorch's eager op runs in eager mode only; one past MIN_SPEEDUP_COMPILED runs in both."""
    client = FakeClient({
        ("softmax", (8, 4096)): Answer({}, "exact", 1.4),
        ("softmax", (8, 8192)): Answer({}, "exact", policy.MIN_SPEEDUP_COMPILED + 0.1),
    })  # fmt: skip
    kato_torch.configure(client=client, gpu="H200")
    assert policy.decide("softmax", (8, 4096), "float16", "cuda") is True
    assert policy.decide("softmax", (8, 4096), "float16", "cuda", compiled=True) is False
    assert policy.decide("softmax", (8, 8192), "float16", "cuda", compiled=True) is True
    kato_torch.configure(client=client, gpu="H200", policy="kato")  # "kato" means always
    assert policy.decide("softmax", (8, 4096), "float16", "cuda", compiled=True) is True


def test_auto_in_eager_mode_asks_a_saving_worth_the_host_cost():
    """A 2x faster kernel that saves a few microseconds a call is not worth a Kato call's host
    cost; one that saves more than MIN_SAVING_MS is. The rule holds inside a compiled graph
    too, whose op decides again in eager terms when the graph runs."""
    tiny = policy.MIN_SAVING_MS / 10
    big = policy.MIN_SAVING_MS * 2

    @dataclass
    class Timed(Answer):
        time_ms: float | None = None
        framework_ms: float | None = None

    client = FakeClient({
        ("layernorm", (8192, 768)): Timed({}, "exact", 2.5, time_ms=tiny, framework_ms=2.5 * tiny),
        ("cross_entropy", (8192, 50257)): Timed({}, "exact", 2.5, time_ms=big,
                                                framework_ms=2.5 * big),
        ("softmax", (8, 4096)): Timed({}, "exact", 2.5),  # no times reported: the ratio decides
    })  # fmt: skip
    kato_torch.configure(client=client, gpu="H200")
    assert policy.decide("layernorm", (8192, 768), "bfloat16", "cuda") is False
    assert policy.decide("layernorm", (8192, 768), "bfloat16", "cuda", compiled=True) is False
    assert policy.decide("cross_entropy", (8192, 50257), "bfloat16", "cuda", compiled=True)
    assert policy.decide("cross_entropy", (8192, 50257), "bfloat16", "cuda") is True
    assert policy.decide("softmax", (8, 4096), "float16", "cuda") is True
    # The small saving is worth a call while the GPU has work queued (decided per call).
    assert policy.verdict("layernorm", (8192, 768), "bfloat16", "cuda") == policy.WHEN_BUSY
    assert policy.verdict("layernorm", (8192, 768), "bfloat16", "cuda", True) == policy.TORCH
    assert policy.verdict("cross_entropy", (8192, 50257), "bfloat16", "cuda") == policy.KATO


def exact(speedup, time_ms, framework_ms, compiled_ms=None):
    """A service's answer (as kato_client reads it) for a winner with these figures."""
    from kato_client.client import Lookup

    answer = {"operator": "softmax", "shape": [8, 4096], "dtype": "float16", "gpu": "H200",
              "config": {}, "source": "exact", "time_ms": time_ms, "framework_ms": framework_ms,
              "speedup": speedup, "compiled_ms": compiled_ms}  # fmt: skip
    return Lookup.from_answer(answer, 0.0)


def test_in_a_compiled_graph_the_measured_compiled_baseline_is_the_bar():
    """Where the answer has compiled_speedup (torch.compile's op timed by the worker), a call
    in a compiled graph needs MIN_SPEEDUP_OVER_COMPILED over it and MIN_SAVING_MS against
    compiled_ms, and the eager verdict KATO too; eager calls keep the eager bar."""
    ms = 10 * policy.MIN_SAVING_MS
    bar = policy.MIN_SPEEDUP_OVER_COMPILED
    # 1.5x eager, just over the bar against Inductor's: below the guessed 2.0 bar, above the
    # measured one.
    modest = exact(1.5, ms, 1.5 * ms, compiled_ms=(bar + 0.01) * ms)
    assert modest.compiled_speedup == pytest.approx(bar + 0.01)
    assert policy.judge(modest, compiled=True) == policy.KATO
    # Just under the bar over the compiled op (Inductor also fuses neighbours in a model).
    close = exact(3.0, ms, 3.0 * ms, compiled_ms=(bar - 0.01) * ms)
    assert policy.judge(close, compiled=True) == policy.TORCH
    # 3x eager, but Inductor's own kernel beats Kato's: the guessed bar would have run Kato.
    fused = exact(3.0, ms, 3.0 * ms, compiled_ms=0.8 * ms)
    assert policy.judge(fused) == policy.KATO
    assert policy.judge(fused, compiled=True) == policy.TORCH
    # Over the measured bar but saving less than a Kato call costs: PyTorch's op.
    small = exact(3.0, ms, 3.0 * ms, compiled_ms=ms + policy.MIN_SAVING_MS / 2)
    assert small.compiled_speedup >= policy.MIN_SPEEDUP
    assert policy.judge(small, compiled=True) == policy.TORCH


def test_a_compiled_yes_is_also_an_eager_yes():
    """Inductor's op alone slower than eager PyTorch's (compiled_ms > framework_ms): a winner
    over the compiled bar but not the eager one would be an opaque op in the graph that runs
    PyTorch's op when the graph runs (the implementation decides eagerly): PyTorch's op."""
    ms = 10 * policy.MIN_SAVING_MS
    clash = exact(1.0, ms, ms, compiled_ms=1.3 * ms)
    assert clash.compiled_speedup >= policy.MIN_SPEEDUP_OVER_COMPILED
    assert policy.judge(clash) == policy.TORCH
    assert policy.judge(clash, compiled=True) == policy.TORCH
    # A saving under MIN_SAVING_MS eagerly (WHEN_BUSY) is no eager "yes" either.
    busy = exact(1.5, policy.MIN_SAVING_MS, 1.5 * policy.MIN_SAVING_MS, compiled_ms=2 * ms)
    assert policy.judge(busy) == policy.WHEN_BUSY
    assert policy.judge(busy, compiled=True) == policy.TORCH


def test_without_a_compiled_baseline_a_compiled_graph_keeps_the_eager_rule():
    ms = 10 * policy.MIN_SAVING_MS
    assert exact(1.4, ms, 1.4 * ms).compiled_speedup is None
    assert policy.judge(exact(1.4, ms, 1.4 * ms), compiled=True) == policy.TORCH
    over = policy.MIN_SPEEDUP_COMPILED + 0.1
    assert policy.judge(exact(over, ms, over * ms), compiled=True) == policy.KATO
    # An answer with the ratios alone (no times): the ratios decide, as for framework_ms.
    assert policy.judge({"source": "exact", "speedup": 1.3, "compiled_speedup": 1.3}, True) == 1
    assert policy.judge({"source": "exact", "speedup": 9.0, "compiled_speedup": 0.9}, True) == 0
    assert policy.judge({"source": "exact", "speedup": 1.0, "compiled_speedup": 1.3}, True) == 0
    client = FakeClient({("softmax", (8, 4096)): exact(1.5, ms, 1.5 * ms, compiled_ms=1.25 * ms)})
    kato_torch.configure(client=client, gpu="H200")
    assert policy.decide("softmax", (8, 4096), "float16", "cuda", compiled=True) is True


def test_auto_without_a_client_or_with_a_failing_one_runs_pytorch():
    assert policy.decide("softmax", (8, 4096), "float16", "cuda") is False

    class Down:
        def lookup(self, *args, **kwargs):
            raise ConnectionError("service down")

    kato_torch.configure(client=Down())
    assert policy.decide("softmax", (8, 4096), "float16", "cuda") is False


def test_kato_and_torch_policies_and_per_operator_overrides():
    kato_torch.configure(policy="kato")
    assert policy.decide("softmax", (8, 4096), "float16", "cuda") is True
    assert policy.decide("softmax", (8, 4096), "float16", "cpu") is False
    kato_torch.configure(policy={"matmul": "torch", "*": "kato"})
    assert policy.decide("matmul", (64, 64, 64), "float16", "cuda") is False
    assert policy.decide("layernorm", (64, 64), "float16", "cuda") is True
    kato_torch.configure(policy={"softmax": "kato"})  # the rest: auto
    assert policy.decide("softmax", (8, 4096), "float16", "cuda") is True
    assert policy.decide("layernorm", (64, 64), "float16", "cuda") is False
    with pytest.raises(ValueError, match="one of auto, kato, torch"):
        kato_torch.configure(policy="fastest")
    with pytest.raises(ValueError, match="'matmul'"):
        kato_torch.configure(policy={"matmul": "always"})


class Block(torch.nn.Module):
    def __init__(self, width=16, classes=10):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.rms = torch.nn.RMSNorm(width, eps=1e-6)
        self.fc = torch.nn.Linear(width, classes)
        self.act = torch.nn.ReLU()
        self.soft = torch.nn.Softmax(dim=-1)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels):
        h = self.act(self.rms(self.norm(x)))
        logits = self.fc(h)
        return self.loss(logits, labels) + self.soft(logits).max()


def test_record_lists_every_forward_and_backward_key_of_a_step():
    model = kato_torch.patch(Block())
    x, labels = torch.randn(6, 16), torch.randint(0, 10, (6,))
    with kato_torch.record() as rec:
        model(x, labels).backward()
    keys = {(k.operator, k.shape, k.dtype) for k in rec.keys}
    assert keys >= {
        ("layernorm", (6, 16), "float32"),
        ("layernorm_backward", (6, 16), "float32"),
        ("rmsnorm", (6, 16), "float32"),
        ("rmsnorm_backward", (6, 16), "float32"),
        ("relu", (96,), "float32"),
        ("matmul_nt", (6, 10, 16), "float32"),
        ("cross_entropy", (6, 10), "float32"),
        ("cross_entropy_backward", (6, 10), "float32"),
        ("softmax", (6, 10), "float32"),
    }
    assert len(rec.keys) == len(set(rec.keys))  # each key once, in first-seen order
    # The GEMMs of the backward pass are captured with the forward's decision.
    assert ("matmul", (6, 16, 10), "float32") in keys
    assert ("matmul_tn", (10, 16, 6), "float32") in keys


def test_submit_queues_the_untuned_keys_as_one_batch():
    client = FakeClient({("softmax", (6, 10)): Answer({}, "exact", 2.0)})
    kato_torch.configure(client=client, gpu="H200")
    with kato_torch.record() as rec:
        kato_torch.softmax(torch.randn(6, 10))
        kato_torch.layer_norm(torch.randn(6, 10), (10,), torch.ones(10), torch.zeros(10))
    assert [k.operator for k in rec.untuned()] == [
        "softmax_backward", "layernorm", "layernorm_backward"
    ]  # fmt: skip
    jobs = rec.submit(budget=40)
    assert len(client.batches) == 1
    sent, gpu, budget, _ = client.batches[0]
    assert gpu == "H200" and budget == 40
    assert [(j["operator"], j["shape"], j["dtype"]) for j in sent] == [
        ("softmax_backward", [6, 10], "float32"),
        ("layernorm", [6, 10], "float32"),
        ("layernorm_backward", [6, 10], "float32"),
    ]
    assert [j["id"] for j in jobs] == ["job0", "job1", "job2"]
    kato_torch.configure(client=None)
    with pytest.raises(ValueError, match="needs a client"):
        rec.submit()


def test_patch_swaps_drop_ins_in_and_out_keeping_state_and_results():
    torch.manual_seed(0)
    model = Block()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, labels = torch.randn(5, 16), torch.randint(0, 10, (5,))
    want = model(x, labels)
    assert kato_torch.patch(model) is model
    assert type(model.norm) is kato_torch.nn.LayerNorm
    assert type(model.rms) is kato_torch.nn.RMSNorm
    assert type(model.fc) is kato_torch.nn.Linear
    assert type(model.act) is kato_torch.nn.ReLU
    assert type(model.soft) is kato_torch.nn.Softmax
    assert type(model.loss) is kato_torch.nn.CrossEntropyLoss
    assert isinstance(model.norm, torch.nn.LayerNorm)
    assert model.state_dict().keys() == state.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key])
    torch.testing.assert_close(model(x, labels), want)
    kato_torch.unpatch(model)
    assert type(model.norm) is torch.nn.LayerNorm and type(model.fc) is torch.nn.Linear
    torch.testing.assert_close(model(x, labels), want)


def test_patch_leaves_subclasses_alone_and_refuses_unknown_classes():
    class MyNorm(torch.nn.LayerNorm):
        pass

    model = torch.nn.Sequential(MyNorm(4), torch.nn.LayerNorm(4), torch.nn.GELU())
    kato_torch.patch(model, only=[torch.nn.LayerNorm])
    assert type(model[0]) is MyNorm and type(model[1]) is kato_torch.nn.LayerNorm
    with pytest.raises(ValueError, match="GELU"):
        kato_torch.patch(model, only=[torch.nn.GELU])


def test_drop_ins_are_constructed_like_torchs_modules():
    norm = kato_torch.nn.LayerNorm(8, eps=1e-6, elementwise_affine=True)
    ref = torch.nn.LayerNorm(8, eps=1e-6)
    ref.load_state_dict(norm.state_dict())
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), ref(x))
    bn = kato_torch.nn.BatchNorm2d(3)
    bn_ref = torch.nn.BatchNorm2d(3)
    y = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(bn(y), bn_ref(y))
    torch.testing.assert_close(bn.running_mean, bn_ref.running_mean)


def test_a_patched_model_compiles_in_one_graph():
    """The policy's decision is a constant for torch.compile: no graph break around it."""
    torch.manual_seed(0)
    model = kato_torch.patch(Block())
    x, labels = torch.randn(6, 16), torch.randint(0, 10, (6,))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, labels), model(x, labels))


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_patched_model_compiles_in_one_graph_at_every_batch_size(dynamic):
    """A new batch size makes torch.compile trace with symbolic sizes (dynamic=None marks the
    changed dimension dynamic at the second size): the decision takes the size as a constant
    (one graph per size) instead of breaking the graph, which fullgraph=True refuses."""
    torch.manual_seed(0)
    model = kato_torch.patch(Block())
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for rows in (6, 7, 9):
        x, labels = torch.randn(rows, 16), torch.randint(0, 10, (rows,))
        torch.testing.assert_close(compiled(x, labels), model(x, labels))


def test_a_shape_the_kernels_refuse_runs_pytorchs_op_whatever_the_policy():
    """Under policy "kato" a shape the operator's spec refuses (rows past the kernels' int
    indices) must not reach the custom op, whose binding would raise InvalidInput: PyTorch's
    op runs, as for any key Kato has no kernel for. CUDA tensors without memory (fake) show
    which op a call dispatches; a shape the spec takes is the control."""
    kato_torch.configure(policy="kato")
    with FakeTensorMode():
        taken = torch.empty(64, 100, device="cuda")
        refused = torch.empty(2**31, 1, device="cuda")  # rows > 2**31 - 1
        with OpLog() as log:
            kato_torch.softmax(taken)
        assert "kato.softmax" in log.ops
        with OpLog() as log, kato_torch.record() as rec:
            y = kato_torch.softmax(refused)
        assert "kato.softmax" not in log.ops and "aten._softmax" in log.ops
        assert y.shape == refused.shape
        assert rec.keys == []  # nothing to tune: the service would refuse the shape too


def test_under_autocast_a_linear_of_bf16_activations_and_float32_weights_is_kato_gemm():
    """Under autocast a Linear after an activation gets bf16 x and its float32 weight:
    torch's autocast runs both in bf16, and so must kato_torch (its keys are bf16 GEMMs),
    not fall back because the types differed before the cast. Fake CUDA tensors: autocast
    casts them as real ones, and record() shows the keys."""
    with FakeTensorMode():
        x = torch.empty(4, 8, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(16, 8, device="cuda")
        b = torch.empty(8, 16, device="cuda")
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        torch.set_autocast_enabled("cuda", True)
        try:
            with kato_torch.record() as rec:
                y = kato_torch.linear(x, w)
                z = kato_torch.matmul(x, b)
        finally:
            torch.set_autocast_enabled("cuda", False)
    assert y.dtype == z.dtype == torch.bfloat16
    keys = {(k.operator, k.shape, k.dtype) for k in rec.keys}
    assert ("matmul_nt", (4, 16, 8), "bfloat16") in keys
    assert ("matmul", (4, 16, 8), "bfloat16") in keys


def test_served_config_reads_every_answer_shape_a_client_gives():
    """A Lookup, the service's JSON answer, and a bare config all give the config to run (the
    service's mapping once gave its whole body as the config, so every bind ran the default)."""
    config = {"BLOCK_SIZE": 128, "VEC": 4}
    assert policy.served_config(Answer(config, "exact", 1.3)) == (config, "exact")
    assert policy.served_config({"config": config, "source": "nearest", "speedup": None}) == (
        config,
        "nearest",
    )
    assert policy.served_config(config) == (config, "client")


def test_a_linear_that_ran_pytorchs_op_reruns_it_until_the_policy_changes():
    """A Linear's key that ran PyTorch's op goes straight to it on the next call (the host
    cost of a small model's step), yet a record() block still sees its keys and a policy
    change decides afresh: under "kato" the same call then runs Kato's GEMM."""
    kato_torch.configure(policy="torch")
    with FakeTensorMode():
        x = torch.empty(64, 32, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(48, 32, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            with OpLog() as log:
                kato_torch.linear(x, w)
            assert "kato.mm" not in log.ops and "aten.mm" in log.ops
        with kato_torch.record() as rec:
            kato_torch.linear(x, w)
        assert ("matmul_nt", (64, 48, 32), "bfloat16") in {
            (k.operator, k.shape, k.dtype) for k in rec.keys
        }
        kato_torch.configure(policy="kato")
        with OpLog() as log:
            kato_torch.linear(x, w)
        assert any(op.startswith("kato.") for op in log.ops), log.ops


def test_a_norm_that_ran_pytorchs_op_reruns_it_until_the_policy_changes():
    """The remembered fallbacks cover every drop-in, a layer norm here."""
    kato_torch.configure(policy="torch")
    with FakeTensorMode():
        x = torch.empty(64, 32, device="cuda")
        w, b = torch.empty(32, device="cuda"), torch.empty(32, device="cuda")
        for _ in range(2):
            with OpLog() as log:
                kato_torch.layer_norm(x, (32,), w, b)
            assert not any(op.startswith("kato.") for op in log.ops), log.ops
        kato_torch.configure(policy="kato")
        with OpLog() as log:
            kato_torch.layer_norm(x, (32,), w, b)
        assert any(op.startswith("kato.") for op in log.ops), log.ops


def test_a_remembered_fallback_follows_the_autocast_dtype():
    """A GEMM that fell back under bfloat16 autocast is not remembered for float16 autocast,
    whose winner beats PyTorch's op: the cast's dtype is part of the key."""

    class ByDtype(FakeClient):
        def lookup(self, operator, shape, dtype, gpu=None):
            self.asked.append((operator, tuple(shape), dtype, gpu))
            return Answer({}, "exact", 2.0) if dtype == "float16" else Answer({}, "default", None)

    kato_torch.configure(client=ByDtype({}), gpu="H200")
    with FakeTensorMode():
        a, b = torch.empty(64, 32, device="cuda"), torch.empty(32, 48, device="cuda")
        torch.set_autocast_enabled("cuda", True)
        try:
            runs = {}
            for dtype in (torch.bfloat16, torch.bfloat16, torch.float16):
                torch.set_autocast_dtype("cuda", dtype)
                with OpLog() as log:
                    kato_torch.matmul(a, b)
                runs.setdefault(dtype, []).append(any(op.startswith("kato.") for op in log.ops))
        finally:
            torch.set_autocast_enabled("cuda", False)
            torch.set_autocast_dtype("cuda", torch.float16)
    assert runs == {torch.bfloat16: [False, False], torch.float16: [True]}


def test_a_cumulative_batch_norm_matches_pytorch_on_every_step():
    """momentum=None (a cumulative average: a new factor every step) leaves the remembered
    key alone; the running statistics still follow PyTorch's on every step."""
    torch.manual_seed(0)
    ours = kato_torch.patch(torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=None)))
    theirs = torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=None))
    for _ in range(4):
        x = torch.randn(2, 3, 4, 4)
        torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours[0].running_mean, theirs[0].running_mean)
    torch.testing.assert_close(ours[0].running_var, theirs[0].running_var)


def test_a_patched_batch_norm_compiles_once_in_one_graph():
    """A drop-in whose fallback memory ignores some arguments (batch norm's momentum and eps)
    traces in one graph, and later calls reuse it: no guard on the eager path's bookkeeping
    (before, dynamo refused its ``min(..., default=)`` under fullgraph and, without it,
    recompiled on every call until its limit)."""
    torch.manual_seed(0)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ours = kato_torch.patch(torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.ReLU()))
    theirs = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.ReLU())
    compiled = torch.compile(ours, fullgraph=True, backend=counting)
    for _ in range(4):
        x = torch.randn(2, 3, 4, 4)
        torch.testing.assert_close(compiled(x), theirs(x))
    assert len(graphs) == 1
    torch.testing.assert_close(ours[0].running_mean, theirs[0].running_mean)


def test_a_remembered_fallback_hashes_its_key_once():
    """A key's hash walks every argument (tens of them for a batch norm): a call that a
    remembered fallback answers looks its key up once, and an unhashable argument decides
    afresh on every call."""
    from kato_torch._fallbacks import remembers_fallbacks

    class Counted:
        hashes = 0

        def __hash__(self) -> int:
            Counted.hashes += 1
            return 7

    ran: list[str] = []

    @remembers_fallbacks(lambda x, tag: ran.append("torch"))
    def op(x, tag):
        ran.append("full")  # no choice for Kato: a fallback, remembered

    x, tag = torch.zeros(3), Counted()
    op(x, tag)
    assert ran == ["full"] and Counted.hashes == 2  # the lookup and the store
    Counted.hashes = 0
    op(x, tag)
    assert ran == ["full", "torch"] and Counted.hashes == 1
    op(x, {"unhashable": 1})
    op(x, {"unhashable": 1})
    assert ran[2:] == ["full", "full"]


def test_a_channels_last_activation_runs_pytorchs_batch_norm_under_auto():
    """Kato's batch-norm kernels take NCHW-contiguous activations: a channels-last input would
    cost a copy in and one back, about what the op costs, so "auto" runs PyTorch's op for it
    (cuDNN takes that layout as it is) while the same winner runs for an NCHW input; "kato"
    still means always. Fake CUDA tensors show which op a call dispatches."""
    shape = (8, 16, 12, 12)
    client = FakeClient({
        (op, shape): Answer({}, "exact", 3.0)
        for op in ("batchnorm_relu", "batchnorm_relu_backward", "batchnorm_add_relu",
                   "batchnorm_add_relu_backward", "batchnorm", "batchnorm_backward")
    } | {("relu", (8 * 16 * 12 * 12,)): Answer({}, "exact", 3.0)})  # fmt: skip
    kato_torch.configure(client=client, gpu="H200")
    with FakeTensorMode():
        x = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        x_last = x.to(memory_format=torch.channels_last)
        w, b = torch.ones(16, device="cuda"), torch.zeros(16, device="cuda")
        mean, var = torch.zeros(16, device="cuda"), torch.ones(16, device="cuda")

        def ops(fn, x, **kw):
            with OpLog() as log:
                fn(x, mean, var, w, b, True, **kw)
            return log.ops

        assert "kato.batch_norm_relu" in ops(kato_torch.batch_norm_relu, x)
        assert "kato.batch_norm_relu" in ops(kato_torch.batch_norm_relu, x, residual=x)
        assert "kato.batch_norm" in ops(kato_torch.batch_norm, x)
        for fn, kw in ((kato_torch.batch_norm_relu, {}), (kato_torch.batch_norm_relu,
                       {"residual": x_last}), (kato_torch.batch_norm, {})):  # fmt: skip
            taken = ops(fn, x_last, **kw)
            assert not any(op.startswith("kato.") for op in taken), taken
            assert any("batch_norm" in op for op in taken), taken
        with OpLog() as log:
            kato_torch.relu(x)
        assert "kato.relu" in log.ops
        with OpLog() as log:
            kato_torch.relu(x_last)
        assert "kato.relu" not in log.ops and "aten.relu" in log.ops
        # A channels-last residual beside an NCHW input is copied too.
        taken = ops(kato_torch.batch_norm_relu, x, residual=x_last)
        assert not any(op.startswith("kato.") for op in taken), taken
        # A fallback remembered for a channels-last call is not one for an NCHW call, by the
        # public function or by a drop-in module of the same shape.
        kato_torch.configure(client=client, gpu="H200")
        assert "kato.batch_norm_relu" not in ops(kato_torch.batch_norm_relu, x_last)
        assert "kato.batch_norm_relu" in ops(kato_torch.batch_norm_relu, x)
        bn = kato_torch.patch(torch.nn.Sequential(torch.nn.BatchNorm2d(16, device="cuda")))
        for data, kato in ((x_last, False), (x, True), (x_last, False)):
            with OpLog() as log:
                bn(data.float())
            assert ("kato.batch_norm" in log.ops) is kato, log.ops
        kato_torch.configure(client=client, gpu="H200", policy="kato")
        assert "kato.batch_norm_relu" in ops(kato_torch.batch_norm_relu, x_last)


def test_a_call_that_needs_a_layout_copy_is_pytorchs_in_eager_and_compiled_graphs():
    """``relayout`` (the call's tensors not in the kernel's layout, or a compiled graph whose
    convolution activations Inductor makes channels-last) turns a winner well over every bar
    into PyTorch's op under "auto", in both modes; the decision is cached per relayout."""
    big = policy.MIN_SPEEDUP_COMPILED * 3
    client = FakeClient({("batchnorm_relu", (8, 16, 12, 12)): Answer({}, "exact", big)})
    kato_torch.configure(client=client, gpu="H200")
    key = ("batchnorm_relu", (8, 16, 12, 12), "bfloat16", "cuda")
    for compiled in (False, True):
        assert policy.decide(*key, compiled=compiled) is True
        assert policy.decide(*key, compiled=compiled, relayout=True) is False
        assert policy.decide(*key, compiled=compiled) is True


def test_a_drop_in_relu_remembers_channels_last_and_nchw_calls_apart():
    """A drop-in ReLU whose channels-last call ran PyTorch's op (its kernel takes contiguous
    tensors) still runs Kato's for an NCHW call of the same shape, and so does another ReLU
    module: the remembered fallback is the channels-last call's only."""
    shape = (8, 16, 12, 12)
    client = FakeClient({("relu", (8 * 16 * 12 * 12,)): Answer({}, "exact", 3.0)})
    kato_torch.configure(client=client, gpu="H200")
    with FakeTensorMode():
        x = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        x_last = x.to(memory_format=torch.channels_last)
        relus = kato_torch.patch(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.ReLU()))
        for module, data, kato in ((0, x_last, False), (0, x, True), (1, x, True),
                                   (0, x_last, False), (1, x_last, False)):  # fmt: skip
            with OpLog() as log:
                relus[module](data)
            assert ("kato.relu" in log.ops) is kato, (module, data.is_contiguous(), log.ops)


@pytest.mark.parametrize("layout_optimization", [True, False])
def test_a_traced_graph_keeps_kato_for_nchw_activations_only_while_inductor_keeps_them(
    layout_optimization,
):
    """In a traced graph (``torch.export`` of fake CUDA tensors: the trace ``torch.compile``
    makes too) Inductor's layout optimisation makes a convolution's activations channels-last:
    while it is on, batch norm and a 4-d ReLU trace PyTorch's op whatever the layout; with it
    off, Kato's op for NCHW activations and PyTorch's for channels-last ones (a copy in and out
    either way). A 2-d ReLU is no convolution's activation: Kato's op in both settings."""
    from torch._inductor import config as inductor_config

    shape = (8, 16, 12, 12)
    big = policy.MIN_SPEEDUP_COMPILED * 3
    client = FakeClient({
        (op, shape): Answer({}, "exact", big)
        for op in ("batchnorm_relu", "batchnorm_relu_backward")
    } | {("relu", (8 * 16 * 12 * 12,)): Answer({}, "exact", big)})  # fmt: skip
    kato_torch.configure(client=client, gpu="H200")

    class BnRelu(torch.nn.Module):
        def forward(self, x, mean, var, w, b):
            return kato_torch.batch_norm_relu(x, mean, var, w, b, True)

    class Relu(torch.nn.Module):
        def forward(self, x):
            return kato_torch.relu(x)

    def traced(module, *args):
        with inductor_config.patch(layout_optimization=layout_optimization):
            graph = torch.export.export(module, args).graph
        return [str(n.target) for n in graph.nodes if n.op == "call_function"]

    with FakeTensorMode():
        x = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        x_last = x.to(memory_format=torch.channels_last)
        w, b = torch.ones(16, device="cuda"), torch.zeros(16, device="cuda")
        mean, var = torch.zeros(16, device="cuda"), torch.ones(16, device="cuda")
        for data, kato in ((x, not layout_optimization), (x_last, False)):
            bn = traced(BnRelu(), data, mean, var, w, b)
            assert ("kato.batch_norm_relu.default" in bn) is kato, bn
            assert kato or "aten.batch_norm.default" in bn, bn
            relu = traced(Relu(), data)
            assert ("kato.relu.default" in relu) is kato, relu
        flat = traced(Relu(), x.view(8 * 16, 12 * 12))
        assert "kato.relu.default" in flat, flat
