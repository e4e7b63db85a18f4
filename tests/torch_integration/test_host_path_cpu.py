"""kato_torch's path to PyTorch's op, on the CPU: the drop-in modules' memory of their fallbacks
(kato_torch/_fallbacks.py ``module_call``), one backlog question per call and the backoff of a
``WHEN_BUSY`` fallback (kato_torch/_backlog.py), and the Python lines a fallback step runs.

A CPU tensor's keys are always PyTorch's op. The ``WHEN_BUSY`` cases use CUDA tensors without
memory (FakeTensorMode), a client whose winners save too little to be KATO, and a stand-in for
the backlog's CUDA probe (``_backlog.stream_lags``)."""

from __future__ import annotations

import copy
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch", reason="kato_torch's tests need PyTorch (the torch extra)")

from op_log import OpLog  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import kato_torch  # noqa: E402
from benchmarks import kato_torch_host_lines as host_lines  # noqa: E402
from kato_torch import _backlog, policy  # noqa: E402


class MLP(torch.nn.Module):
    """benchmarks/torch_train.py's MLP: three Linear, two LayerNorm + ReLU, cross-entropy."""

    def __init__(self, dims=(16, 32, 32, 10)):
        super().__init__()
        d0, d1, d2, d3 = dims
        self.body = torch.nn.Sequential(
            torch.nn.Linear(d0, d1), torch.nn.LayerNorm(d1), torch.nn.ReLU(),
            torch.nn.Linear(d1, d2), torch.nn.LayerNorm(d2), torch.nn.ReLU(),
            torch.nn.Linear(d2, d3),
        )  # fmt: skip
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels):
        return self.loss(self.body(x), labels)


def _kato(model):
    return kato_torch.fuse(kato_torch.patch(model))


def _kato_ran(log) -> bool:
    return any(op.startswith("kato.") for op in log.ops)


class SmallSaving:
    """A client whose every winner is 2x PyTorch's op but saves a microsecond: WHEN_BUSY."""

    def lookup(self, operator, shape, dtype, gpu=None):
        return {"config": {}, "source": "exact", "speedup": 2.0, "time_ms": 0.001,
                "framework_ms": 0.002}  # fmt: skip


class StandIn:
    """The backlog's CUDA probe: answers from ``script`` (call number -> answer, else
    ``default``), recording the call numbers it was asked at."""

    def __init__(self, default=False, script=None):
        self.default, self.script = default, script or {}
        self.call = 0  # set by the test before each call
        self.asked = []

    def __call__(self, t):
        self.asked.append(self.call)
        return self.script.get(self.call, self.default)


class Clock:
    """The host's clock as :class:`kato_torch._backlog.Backoff` reads it (``_backlog.clock``):
    ``now`` seconds, moved only by the test."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    """A clock that stands still unless the test moves it: a schedule counted in calls does
    not depend on how fast the machine runs them."""
    stopped = Clock()
    monkeypatch.setattr(_backlog, "clock", stopped)
    return stopped


@pytest.fixture
def backlog(monkeypatch, clock):
    def make(**kwargs):
        stand_in = StandIn(**kwargs)
        monkeypatch.setattr(_backlog, "stream_lags", stand_in)
        monkeypatch.setattr(_backlog, "capturing", lambda: False)  # no CUDA graph here
        return stand_in

    return make


def count_lines(fn) -> int:
    """Lines of kato_torch's modules ``fn`` runs (any thread; a coverage tracer kept)."""
    return host_lines.count_lines(fn)["kato_torch"]


# --- the drop-ins' fallback -------------------------------------------------------------------


def test_a_fused_mlp_step_on_pytorchs_ops_is_eagers_and_runs_few_lines_of_kato_torch():
    """Every key PyTorch's (CPU tensors): the patched and fused MLP's loss and gradients are
    the plain model's, bitwise, on every step, and a step runs at most 100 lines of
    kato_torch's Python (90 when written; 201 before the drop-ins remembered their fallbacks,
    benchmarks/kato_torch_mlp_host.py): six calls, each a key comparison and the functional."""
    torch.manual_seed(0)
    plain = MLP()
    ours = _kato(copy.deepcopy(plain))
    x, labels = torch.randn(8, 16), torch.randint(0, 10, (8,))

    def step(model):
        model.zero_grad()
        loss = model(x, labels)
        loss.backward()
        return loss

    for _ in range(3):
        assert torch.equal(step(ours), step(plain))
        for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
    lines = count_lines(lambda: step(ours))
    assert 0 < lines <= 100, lines


def test_record_still_sees_every_key_of_a_remembered_step_and_the_fast_path_resumes():
    torch.manual_seed(0)
    model = _kato(MLP())
    x, labels = torch.randn(8, 16), torch.randint(0, 10, (8,))
    for _ in range(2):
        model(x, labels).backward()
    lines = count_lines(lambda: model(x, labels))
    for _ in range(2):  # every step of a record() block sees every key, once
        with kato_torch.record() as rec:
            model(x, labels).backward()
        keys = {(k.operator, k.shape) for k in rec.keys}
        assert len(rec.keys) == len(keys)
        assert keys == {
            ("matmul_nt", (8, 32, 16)), ("matmul", (8, 16, 32)), ("matmul_tn", (32, 16, 8)),
            ("matmul_nt", (8, 32, 32)), ("matmul", (8, 32, 32)), ("matmul_tn", (32, 32, 8)),
            ("matmul_nt", (8, 10, 32)), ("matmul", (8, 32, 10)), ("matmul_tn", (10, 32, 8)),
            ("layernorm_relu", (8, 32)), ("layernorm_relu_backward", (8, 32)),
            ("cross_entropy", (8, 10)), ("cross_entropy_backward", (8, 10)),
        }  # fmt: skip
    assert count_lines(lambda: model(x, labels)) == lines


def test_a_drop_in_follows_configure_autocast_and_its_parameters():
    """A drop-in that ran PyTorch's op runs it again only under the same policy generation,
    autocast dtype and parameter types: each change decides afresh (fake CUDA tensors)."""

    class ByDtype:
        def lookup(self, operator, shape, dtype, gpu=None):
            fast = dtype == "float16"
            return {"config": {}, "source": "exact" if fast else "default", "speedup": 2.0}

    with FakeTensorMode():
        linear = kato_torch.nn.Linear(32, 48, device="cuda", dtype=torch.bfloat16)
        ln = kato_torch.nn.LayerNorm(48, device="cuda")
        x = torch.empty(64, 32, device="cuda", dtype=torch.bfloat16)
        h = torch.empty(64, 48, device="cuda")
        kato_torch.configure(policy="torch")
        for _ in range(2):
            with OpLog() as log:
                linear(x)
                ln(h)
            assert not _kato_ran(log), log.ops
        kato_torch.configure(policy="kato")
        with OpLog() as log:
            linear(x)
            ln(h)
        assert "kato.mm" in log.ops and "kato.layer_norm" in log.ops
        kato_torch.configure(client=ByDtype())  # auto: only float16 GEMMs are Kato's
        torch.set_autocast_enabled("cuda", True)
        try:
            runs = []
            for dtype in (torch.bfloat16, torch.bfloat16, torch.float16):
                torch.set_autocast_dtype("cuda", dtype)
                with OpLog() as log:
                    linear(x)
                runs.append(_kato_ran(log))
        finally:
            torch.set_autocast_enabled("cuda", False)
            torch.set_autocast_dtype("cuda", torch.float16)
        assert runs == [False, False, True]
        with OpLog() as log:
            linear(x)  # float32 weights and bfloat16 x, no autocast: torch's op
        assert not _kato_ran(log)
        # The same module and input, its parameters now float16 (x converted).
        linear.weight = torch.nn.Parameter(torch.empty(48, 32, device="cuda", dtype=torch.half))
        linear.bias = torch.nn.Parameter(torch.empty(48, device="cuda", dtype=torch.half))
        with OpLog() as log:
            linear(x.half())
        assert "kato.mm" in log.ops


def test_a_module_that_remembered_its_fallback_copies_and_pickles_without_it(backlog):
    """The memory holds a lock (a WHEN_BUSY fallback's Backoff) and a policy generation, which
    mean nothing in a copy: deepcopy and pickle work, and the copy decides afresh."""
    backlog(default=False)
    model = _kato(MLP())
    x, labels = torch.randn(8, 16), torch.randint(0, 10, (8,))
    model(x, labels)
    fc = model.body[0]
    assert any(k.startswith("_kato_") and v is not None for k, v in fc.__dict__.items())
    fc.__dict__["_kato_linear"].remembered = _backlog.Backoff()  # as a WHEN_BUSY fallback's
    twin = copy.deepcopy(model)
    assert twin.body[0].__dict__["_kato_linear"] is None
    assert torch.equal(twin(x, labels), model(x, labels))
    patched = kato_torch.patch(MLP())  # a fused model pickles by its state dict; this one whole
    patched(x, labels)
    patched.body[0].__dict__["_kato_linear"].remembered = _backlog.Backoff()
    again = pickle.loads(pickle.dumps(patched))
    assert again.body[0].__dict__["_kato_linear"] is None
    assert torch.equal(again(x, labels), patched(x, labels))


def _replica(model, device=None):
    """What ``torch.nn.parallel.replicate`` (``nn.DataParallel``'s, once per forward; it needs
    CUDA) makes of ``model`` for one device: each module's ``_replicate_for_data_parallel()``
    (a copy of its ``__dict__``), wired to its children's copies, with the parameters (moved
    to ``device``, as the broadcast does) set as plain attributes."""
    modules = list(model.modules())
    copies = {m: m._replicate_for_data_parallel() for m in modules}
    for m, replica in copies.items():
        for name, child in m._modules.items():
            setattr(replica, name, None if child is None else copies[child])
        for name, p in m._parameters.items():
            setattr(replica, name, p if p is None or device is None else p.to(device))
    return copies[model]


def test_dataparallel_replicas_of_a_never_called_model_find_its_fallbacks(monkeypatch):
    """On several GPUs DataParallel calls fresh replicas, never the model: every replica starts
    with the model's empty memory and drops what it writes. Its drop-ins' calls still run
    PyTorch's functional after a key lookup in the process's memory of drop-in calls: at most
    5 more lines of kato_torch for each of its six calls than the model's own memory runs (120
    and 90 when written; 356 where a replica went through each public function's memory), with
    the plain model's loss and gradients, in threads too; the model's own memory stays
    empty."""
    torch.manual_seed(0)
    plain = MLP()
    model = _kato(copy.deepcopy(plain))
    x, labels = torch.randn(8, 16), torch.randint(0, 10, (8,))
    for _ in range(3):
        model.zero_grad(), plain.zero_grad()
        loss = _replica(model)(x, labels)
        loss.backward()
        assert torch.equal(loss, plain(x, labels).detach())
        plain(x, labels).backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
    assert not any(k.startswith("_kato_") for m in model.modules() for k in m.__dict__)
    replica_lines = count_lines(lambda: _replica(model)(x, labels))
    for _ in range(2):
        model(x, labels)  # now the model's own memory (one GPU: DataParallel calls the model)
    own_lines = count_lines(lambda: model(x, labels))
    assert 0 < own_lines < replica_lines <= own_lines + 5 * 6, (own_lines, replica_lines)
    # DataParallel's replicas run in threads: at a new batch size, four replicas at a time
    # miss the memory together, then find it.
    x, labels = torch.randn(16, 16), torch.randint(0, 10, (16,))
    expected = plain(x, labels)
    with ThreadPoolExecutor(4) as pool:
        losses = list(pool.map(lambda _: _replica(model)(x, labels), range(100)))
    assert all(torch.equal(loss, expected) for loss in losses)


# --- WHEN_BUSY: one question per call, and the backoff -----------------------------------------


def _when_busy_linear():
    kato_torch.configure(client=SmallSaving())
    assert policy.verdict("matmul_nt", (64, 48, 32), "bfloat16", "cuda") == policy.WHEN_BUSY
    return kato_torch.nn.Linear(32, 48, device="cuda", dtype=torch.bfloat16)


def _linear_call():
    linear = _when_busy_linear()
    x = torch.empty(64, 32, device="cuda", dtype=torch.bfloat16)
    return lambda: linear(x)


def _kato_calls(stand_in, calls, make):
    """The calls, numbered 1 to ``calls`` (``stand_in.call``), at which the callable that
    ``make()`` returns (under fake CUDA tensors) ran something of Kato's."""
    kato_at = []
    with FakeTensorMode():
        call_once = make()
        for call in range(1, calls + 1):
            stand_in.call = call
            with OpLog() as log:
                call_once()
            if _kato_ran(log):
                kato_at.append(call)
    return kato_at


#: The calls (numbered from 1) at which a WHEN_BUSY fallback asks, the answer always "no":
#: every call up to 8 "no"s in a row, then twice (the first marks the stream, uncounted) after
#: skipping 1, 2, 4, ... 64 calls.
NO_SCHEDULE = [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 14, 15, 20, 21, 30, 31, 48, 49, 82, 83, 148, 149,
               214, 215, 280, 281]  # fmt: skip


def test_a_host_bound_when_busy_module_backs_off_and_a_yes_starts_again(backlog):
    assert (_backlog.BACKOFF_AFTER, _backlog.MAX_SKIP) == (8, 64)
    stand_in = backlog(script={48: True})
    kato_at = _kato_calls(stand_in, 300, _linear_call)
    assert kato_at == [48]  # Kato's GEMM only where the backlog said "yes"
    # Up to 48 the "no" schedule; the "yes" at 48 starts it again from call 49.
    again = [48 + c for c in NO_SCHEDULE if 48 + c <= 300]
    assert stand_in.asked == [c for c in NO_SCHEDULE if c <= 48] + again


class _Gpu:
    """A simulated GPU for the real :class:`kato_torch._backlog.Backlog`: the host's clock
    (``now``, seconds) and events that the GPU reaches ``behind`` seconds after the host
    recorded them."""

    def __init__(self):
        self.now, self.behind = 0.0, 0.0
        gpu = self

        class Event:
            def record(self, stream):
                self.reached_at = gpu.now + gpu.behind

            def query(self):
                return gpu.now >= self.reached_at

        class Stream:
            device_index, cuda_stream = 0, 0

        self.Event, self.stream = Event, Stream()


@pytest.mark.parametrize("step_s", [1e-3, 25e-3])
def test_a_backed_off_fallback_hears_yes_soon_after_the_step_turns_gpu_bound(monkeypatch, step_s):
    """300 steps of ``step_s`` with the GPU keeping up back a fallback off to its longest
    skip; then the GPU falls 5 steps behind for good. The real Backlog reads the newest mark
    at least 0.1 ms old: a probe asked alone after a long skip would read its own mark from
    that long ago, long reached, and say "no" forever; the uncounted first question marks the
    stream so that the next one reads a mark 1 step old and says "yes". The site runs
    PyTorch's op for at most MAX_SKIP + 2 more of its calls (1 ms steps), and for at most
    MAX_SKIP_S and two calls where that is fewer (25 ms steps: 6 calls, not 66)."""
    gpu = _Gpu()
    backlog = _backlog.Backlog(policy.MIN_SAVING_MS)
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(_backlog, "clock", lambda: gpu.now)
    monkeypatch.setattr(_backlog, "stream_lags", lambda t: backlog.deep(gpu.stream))
    monkeypatch.setattr(_backlog, "capturing", lambda: False)
    site, t = _backlog.Backoff(), torch.zeros(1)
    answers = []
    for step in range(600):
        gpu.now += step_s
        gpu.behind = 0.0 if step < 300 else 5 * step_s
        answers.append(site.lagging(t))
    assert not any(answers[:300])
    first = answers.index(True, 300)
    # Skips of up to min(MAX_SKIP, MAX_SKIP_S / step_s) calls (64; 4), then two questions.
    assert (_backlog.MAX_SKIP, _backlog.MAX_SKIP_S) == (64, 0.1)
    assert first <= 300 + {1e-3: 66, 25e-3: 6}[step_s], first
    assert all(answers[first:])  # a "yes" asks on every call again


def _asked(backlog, clock, calls, seconds_per_call):
    """The calls (numbered from 1) at which a new Backoff, its answer always "no", asked the
    backlog, ``clock`` moving ``seconds_per_call`` before each call."""
    stand_in = backlog(default=False)
    site, t = _backlog.Backoff(), torch.zeros(1)
    for call in range(1, calls + 1):
        clock.now += seconds_per_call
        stand_in.call = call
        assert site.lagging(t) is False
    return stand_in.asked


def test_a_skip_ends_after_max_skip_s_or_max_skip_calls_whichever_comes_first(backlog, clock):
    """A site called once per 2/7 of MAX_SKIP_S skips at most the 3 calls that fit in it, then
    asks twice (the first only marks the stream); called 1000 times as often, it keeps the
    schedule counted in calls (NO_SCHEDULE, skips of up to MAX_SKIP calls)."""
    assert _backlog.MAX_SKIP_S == 0.1
    slow = _asked(backlog, clock, 100, _backlog.MAX_SKIP_S / 3.5)
    # 1-8, then pairs after skipping 1 and 2 calls, then after 3 (not 4, 8, ...) every time.
    assert slow == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 14, 15] + [
        c for c in range(19, 101) if (c - 19) % 5 in (0, 1)
    ]
    fast = _asked(backlog, clock, 300, _backlog.MAX_SKIP_S / 1000)
    assert fast == NO_SCHEDULE  # 300 calls take 0.03 s: no skip lasts MAX_SKIP_S


def test_dataparallel_replicas_on_two_gpus_share_one_backoff_per_gpu(backlog, monkeypatch):
    """A WHEN_BUSY Linear replicated on two GPUs for 100 forwards, the GPU keeping up: every
    replica of one GPU sees the same Backoff, the other GPU's another (the key holds the
    device), so each GPU's replicas ask as one module called 100 times does (NO_SCHEDULE),
    and never run Kato's. (The replicas run in turn: fake tensors serve one thread; the test
    above runs replicas in threads.)"""
    backlog(default=False)
    lock, asked = threading.Lock(), {"cuda:0": 0, "cuda:1": 0}

    def stream_lags(t):
        with lock:
            asked[str(t.device)] += 1
        return False

    monkeypatch.setattr(_backlog, "stream_lags", stream_lags)
    seen = {device: [] for device in asked}  # the memory each GPU's replicas saw
    with FakeTensorMode():
        linear = _when_busy_linear()
        xs = {d: torch.empty(64, 32, device=d, dtype=torch.bfloat16) for d in asked}
        for _ in range(100):
            replicas = {d: _replica(linear, d) for d in xs}
            with OpLog() as log:
                for d, replica in replicas.items():
                    replica(xs[d])
            assert not _kato_ran(log)
            for d, replica in replicas.items():
                seen[d].append(replica.__dict__["_kato_linear"].remembered)
    assert "_kato_linear" not in linear.__dict__
    on_0, on_1 = ({id(b) for b in seen[d]} for d in asked)
    assert len(on_0) == len(on_1) == 1 and on_0 != on_1
    assert isinstance(seen["cuda:0"][0], _backlog.Backoff)
    assert asked == {d: len([c for c in NO_SCHEDULE if c <= 100]) for d in asked}


def test_a_backed_off_fallback_is_not_skipped_while_a_cuda_graph_is_captured(backlog):
    """A capture records the call's kernel for every replay, where the host's cost is gone:
    a call captured while the module's fallback backs off runs Kato's GEMM, not PyTorch's."""
    stand_in = backlog(default=False)
    captured = {60}
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(_backlog, "capturing", lambda: stand_in.call in captured)
    stand_in.script = {c: True for c in captured}  # stream_lags: True while capturing
    try:
        kato_at = _kato_calls(stand_in, 100, _linear_call)
    finally:
        monkeypatch.undo()
    assert 60 not in NO_SCHEDULE  # a call the backoff would skip
    assert kato_at == [60]


def test_a_gpu_bound_when_busy_module_asks_once_per_call_and_runs_kato(backlog):
    """The GPU far behind on every call: each call asks once (its forward's and backward's
    three GEMM keys share the answer) and runs Kato's GEMM."""
    stand_in = backlog(default=True)
    assert _kato_calls(stand_in, 20, _linear_call) == list(range(1, 21))
    assert stand_in.asked == list(range(1, 21))


def test_a_functions_two_keys_share_one_answer_and_its_fallback_backs_off(backlog):
    """kato_torch.layer_norm_relu (not a module: the remembered fallback's own Backoff) asks
    for its forward and backward keys once per call, with the same schedule."""
    kato_torch.configure(client=SmallSaving())
    stand_in = backlog(script={c: True for c in range(1, 4)})

    def layer_norm_relu_call():
        x = torch.empty(64, 48, device="cuda")
        w, b = torch.empty(48, device="cuda"), torch.empty(48, device="cuda")
        return lambda: kato_torch.layer_norm_relu(x, (48,), w, b)

    kato_at = _kato_calls(stand_in, 300, layer_norm_relu_call)
    assert kato_at == [1, 2, 3]
    assert stand_in.asked == [1, 2, 3] + [3 + c for c in NO_SCHEDULE if 3 + c <= 300]


def test_a_backoff_shared_by_threads_keeps_its_schedule(backlog):
    """Autograd's and DataParallel's threads may ask through one Backoff at once: its
    schedule counts their calls in the order they came, so 8 threads of 100 calls ask as
    often as one thread of 800 does."""
    stand_in = backlog(default=False)
    shared = _backlog.Backoff()
    t = torch.zeros(1)
    start = threading.Barrier(8)
    answers = []

    def run():
        start.wait()
        answers.extend(shared.lagging(t) for _ in range(100))

    threads = [threading.Thread(target=run) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    alone = _backlog.Backoff()
    serial = StandIn()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_backlog, "stream_lags", serial)
        assert not any(alone.lagging(t) for _ in range(800))
    assert len(answers) == 800 and not any(answers)
    # 1-8, then pairs at 10, 14, 20, 30, 48, 82, then every 66th call: 148, 214, ... 742.
    assert len(stand_in.asked) == len(serial.asked) == 8 + 2 * 6 + 2 * 10


def test_a_when_busy_mlp_step_bound_by_the_host_runs_few_lines(backlog):
    """The fused MLP with every key WHEN_BUSY and the GPU keeping up (fake CUDA tensors):
    once backed off, a forward asks nothing most steps and runs at most 130 lines of
    kato_torch (120 when written; six calls: a key comparison, the Backoff's skip, the
    functional)."""
    kato_torch.configure(client=SmallSaving())
    stand_in = backlog(default=False)
    with FakeTensorMode():
        with torch.device("cuda"):
            model = _kato(MLP((32, 64, 64, 16)))
        x = torch.empty(64, 32, device="cuda")
        labels = torch.zeros(64, dtype=torch.int64, device="cuda")
        for _ in range(100):
            model(x, labels)
        asked = len(stand_in.asked)
        lines = count_lines(lambda: model(x, labels))
    assert len(stand_in.asked) == asked
    assert 0 < lines <= 130, lines


def test_a_drop_in_called_with_two_shapes_in_turn_still_backs_off(backlog):
    """One module at two shapes in turn (a ResNet bottleneck's single ReLU, at three): its
    memory holds one key, so every call misses it; the call then goes through the public
    function's own memory, whose Backoff per key backs off, instead of asking on every call."""
    kato_torch.configure(client=SmallSaving())
    stand_in = backlog(default=False)

    def relu_call():
        relu = kato_torch.nn.ReLU()
        xs = [torch.empty(64, 32, device="cuda"), torch.empty(64, 48, device="cuda")]
        calls = iter(range(10**6))
        return lambda: relu(xs[next(calls) % 2])

    assert _kato_calls(stand_in, 400, relu_call) == []
    # Each shape's key asks on its first 8 calls, then twice per up to 66 of its calls.
    assert len(stand_in.asked) <= 2 * (8 + 2 * 8), len(stand_in.asked)
