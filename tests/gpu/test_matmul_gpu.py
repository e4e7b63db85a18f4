"""matmul, matmul_nt and matmul_tn on a real GPU: every dtype, awkward shapes, default config
and every valid variant.

Shapes: single elements, primes, GEMV-like M=1 / N=1, K not a multiple of BK, a very tall
70000 x 64 x 64, 4096^3 (the default's wide-tile path), and rows whose pitch is not a multiple
of the vector width (which loads those rows' vectors element by element). The variant sweeps
run every valid config of each layout in each alignment class: matmul at 129 x 136 x 264 (every
matrix aligned, nothing a multiple of a tile) and 67 x 131 x 97 (all odd); every layout at
127 x 129 x 131, 1 x 1 x 1 and 33 x 8191 x 17 (no row aligned: VEC 4 and 8 stay valid), and at
136 x 136 x 264 (aligned); and a sample of the two mixed classes (one operand aligned). Those
sweeps cover the mma.sync engine; the wgmma engine's (sm_90 only) are the last section.
"""

from __future__ import annotations

import pytest
from kato.kernels import get_operator
from verify_harness import verify_variants

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
OPERATORS = ["matmul", "matmul_nt", "matmul_tn"]
AWKWARD = [
    (1, 1, 1),
    (127, 131, 257),
    (1, 4096, 4096),
    (4096, 1, 4096),
    (300, 200, 1000),
    (70000, 64, 64),
    (129, 136, 264),
    (4096, 4096, 4096),
    (33, 8191, 17),
    (4095, 4097, 4093),
    (1025, 768, 3071),
]
_IDS = {"ids": lambda s: "x".join(map(str, s))}


def is_mma(config) -> bool:
    """The mma.sync sweeps below; the wgmma configs and float32's split-K clusters have tests
    of their own (at the end)."""
    return config["ENGINE"] == "mma" and config["SPLIT_K"] == 1


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, **_IDS)
@pytest.mark.parametrize("operator", OPERATORS)
def test_default_config_verifies(operator, shape, dtype):
    """The backend's device-side verification (poisoned C, float64 reference, K-scaled
    tolerance) passes for the default config."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    spec = get_operator(operator)
    backend = PyCudaBackend(spec, shape, dtype, repeats=1, warmup=0, seed=0)
    try:
        config = spec.default_config(shape, dtype)
        assert backend.check(config) is None
        calls = backend.load(backend.compile(config), spec.steps(config, shape, dtype))
        assert backend.verify(calls) is None
    finally:
        backend.close()


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(129, 136, 264), (67, 131, 97)], **_IDS)
def test_every_valid_matmul_variant_verifies(shape, dtype):
    checked, failures = verify_variants(get_operator("matmul"), shape, dtype, seed=1, where=is_mma)
    # every valid config: 86 / 60 / 60 at 129x136x264; 78 / 18 / 18 at 67x131x97 (VEC 4 / 8
    # load the unaligned rows element by element)
    assert checked >= 18
    assert not failures, f"{len(failures)} of {checked} failed: {failures[:5]}"


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(127, 129, 131), (1, 1, 1), (33, 8191, 17)], **_IDS)
@pytest.mark.parametrize("operator", OPERATORS)
def test_every_valid_variant_verifies_where_no_row_is_aligned(operator, shape, dtype):
    spec = get_operator(operator)
    checked, failures = verify_variants(spec, shape, dtype, seed=2, where=is_mma)
    assert {c["VEC"] for c in spec_space(spec, shape, dtype)} == (
        {1, 4} if dtype == "float32" else {1, 8}
    )
    assert checked >= 18  # 78 / 78 / 38 float32 (matmul, _nt, _tn), 18 on tensor cores
    assert not failures, f"{len(failures)} of {checked} failed: {failures[:5]}"


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("operator", ["matmul_nt", "matmul_tn"])
def test_every_valid_layout_variant_verifies_aligned(operator, dtype):
    spec = get_operator(operator)
    checked, failures = verify_variants(spec, (136, 136, 264), dtype, seed=3, where=is_mma)
    assert checked >= 40  # 86 / 60 / 60 (matmul_nt), 40 / 60 / 60 (matmul_tn)
    assert not failures, f"{len(failures)} of {checked} failed: {failures[:5]}"


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(136, 129, 264), (129, 136, 263)], **_IDS)
@pytest.mark.parametrize("operator", OPERATORS)
def test_mixed_alignment_variants_verify(operator, shape, dtype):
    """Some of A, B and C aligned, the others not (pitches K or M, K or N, N): 24 configs."""
    spec = get_operator(operator)
    checked, failures = verify_variants(spec, shape, dtype, max_configs=24, seed=4, where=is_mma)
    assert checked >= 24
    assert not failures, f"{len(failures)} of {checked} failed: {failures[:5]}"


def spec_space(spec, shape, dtype):
    """The valid mma.sync configs (from the spec's candidates: the whole product is 500k)."""
    found = spec.candidates(shape, dtype)
    return [c for c in found if is_mma(c) and spec.check(c, shape, dtype) is None]


# --- the wgmma path (ENGINE="wgmma", sm_90 only) ------------------------------------------------
#
# Every valid wgmma config of each layout and 16-bit dtype (every tile, stage count, cluster
# and persistent class) at shapes whose M, N and K are multiples of no tile (1000^3; 2056 x
# 2048 x 264, where every persistent config is valid: more cluster tiles than the 132 CTAs), a
# shape below every tile (8 x 16 x 8), and for matmul_nt the vocabulary width N = 50257 (B is
# (N, K): its pitch is K). The sources do not depend on the shape, so each config compiles
# once for all of them.

WGMMA_DTYPES = ["float16", "bfloat16"]
WGMMA_SHAPES = {
    "matmul": [(1000, 1000, 1000), (2056, 2048, 264), (8, 16, 8)],
    "matmul_nt": [(1000, 1000, 1000), (2056, 2048, 264), (8, 16, 8), (136, 50257, 72)],
    "matmul_tn": [(1000, 1000, 1000), (2056, 2048, 264), (8, 16, 8)],
}


def _sm90_reason() -> str | None:
    try:
        import pycuda.driver as cuda

        cuda.init()
        major, minor = cuda.Device(0).compute_capability()
    except Exception as exc:  # conftest skips the module's tests then anyway
        return f"no CUDA device: {exc}"
    if (major, minor) != (9, 0):
        return f"the wgmma path needs sm_90 (wgmma, setmaxnreg); this GPU is sm_{major}{minor}"
    return None


sm90 = pytest.mark.skipif(bool(_sm90_reason()), reason=_sm90_reason() or "")


def _wgmma_configs(spec, shape, dtype):
    return [
        c
        for c in spec.candidates(shape, dtype)
        if c["ENGINE"] == "wgmma" and spec.check(c, shape, dtype) is None
    ]


@sm90
@pytest.mark.parametrize("dtype", WGMMA_DTYPES)
@pytest.mark.parametrize(
    ("operator", "shape"),
    [(op, shape) for op, shapes in WGMMA_SHAPES.items() for shape in shapes],
    ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)),
)
def test_every_wgmma_config_verifies(operator, shape, dtype):
    """The backend's own verification (poisoned C, float64 reference, twice) of every valid
    wgmma config: what a tuning job measures."""
    spec = get_operator(operator)
    configs = _wgmma_configs(spec, shape, dtype)
    classes = {(c["BM"], c["BN"], c["CLUSTER_M"], c["PERSISTENT"]) for c in configs}
    # 13 tile x cluster classes (8 tiles, 5 of them with BN >= 128 also in 2-CTA clusters) at
    # 3 stage counts, each persistent too where that changes the grid (every one at 2056)
    if shape == (2056, 2048, 264):
        assert {c["PERSISTENT"] for c in configs} == {0, 1} and len(classes) == 26, classes
    assert len(configs) >= 13 * 3 * (2 if shape == (2056, 2048, 264) else 1)
    failures = _verify_all(spec, shape, dtype, configs)
    assert not failures, f"{len(failures)} of {len(configs)} failed: {failures[:3]}"


#: Shapes for the wgmma variants added for issue 32's training shapes (TMA-store epilogue,
#: 5 and 6 stages, split-K clusters): a persistent grid (2056 x 2048: more tiles than CTAs, so
#: each CTA reuses its staged C tile; 5 k blocks, split up to 4 ways), a tile that TMA clips
#: on both sides (8 x 16 x 8), M, N and K that are multiples of no tile (1032 x 3080 x 72: one
#: k block and 8 more), and 16 k blocks, the last ragged, split into unequal ranges (5, 5, 6).
NEW_VARIANT_SHAPES = [(2056, 2048, 264), (8, 16, 8), (1032, 3080, 72), (264, 1032, 1000)]


def _is_new_variant(config) -> bool:
    new = config["EPILOGUE"] or config["SPLIT_K"] > 1 or config["PINGPONG"]
    return bool(new) or config["STAGES"] > 4


@sm90
@pytest.mark.parametrize("dtype", WGMMA_DTYPES)
@pytest.mark.parametrize("operator", list(WGMMA_SHAPES))
@pytest.mark.parametrize("shape", NEW_VARIANT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_new_wgmma_variants_verify(operator, shape, dtype):
    """Every valid EPILOGUE=1, 5-6 stage, SPLIT_K > 1 or PINGPONG=1 config (persistent or
    not, clusters or not) passes the backend's verification (poisoned C, float64 reference,
    twice: the second run shows that the staged C tile, the store groups and the split-K
    exchange leave nothing behind)."""
    spec = get_operator(operator)
    configs = [c for c in _wgmma_configs(spec, shape, dtype) if _is_new_variant(c)]
    assert {c["EPILOGUE"] for c in configs} == {0, 1}
    if shape == (2056, 2048, 264):
        assert {c["PERSISTENT"] for c in configs} == {0, 1}
        assert {c["SPLIT_K"] for c in configs} == {1, 2, 3, 4}
        assert {c["PINGPONG"] for c in configs} == {0, 1}
    if shape == (264, 1032, 1000):
        assert {c["SPLIT_K"] for c in configs} == {1, 2, 3, 4}
    failures = _verify_all(spec, shape, dtype, configs)
    assert not failures, f"{len(failures)} of {len(configs)} failed: {failures[:3]}"


def _verify_all(spec, shape, dtype, configs):
    """(config, error) of every config that fails the backend's checks or verification, on one
    problem (compiles in parallel ahead)."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    backend = PyCudaBackend(spec, shape, dtype, repeats=1, warmup=0, seed=5)
    try:
        backend.precompile(configs)
        failures = []
        for config in configs:
            if reason := backend.check(config):
                failures.append((config, reason))
                continue
            calls = backend.load(backend.compile(config), spec.steps(config, shape, dtype))
            if error := backend.verify(calls):
                failures.append((config, error))
        return failures
    finally:
        backend.close()


@sm90
def test_wgmma_configs_are_invalid_where_tma_cannot_address_a_row():
    """matmul with N = 50257 (B's pitch): no wgmma config; the backend's space keeps the rest."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    spec = get_operator("matmul")
    backend = PyCudaBackend(spec, (64, 50257, 64), "bfloat16", repeats=1, warmup=0, seed=0)
    try:
        engines = {c["ENGINE"] for c in backend.space().valid_configs()}
    finally:
        backend.close()
    assert engines == {"mma"}


@sm90
@pytest.mark.parametrize("epilogue", [0, 1])
def test_a_served_wgmma_config_runs_through_kato_torch(epilogue):
    """kato_torch launches a wgmma winner (its tensor maps built per call from the tensors'
    pointers, cached per buffer) for the forward and both backward layouts of a matmul; with
    EPILOGUE 1, C's map too."""
    import torch

    import kato_torch
    from kato_torch import _kernels

    served = {
        "BM": 128, "BN": 128, "BK": 64, "WM": 64, "WN": 64, "TM": 4, "TN": 4, "VEC": 8,
        "STAGES": 4, "PAD": 0, "MIN_BLOCKS": 0, "ENGINE": "wgmma", "CLUSTER_M": 2,
        "PERSISTENT": 0, "EPILOGUE": epilogue, "SPLIT_K": 1, "PINGPONG": 0, "STREAM_K": 0,
    }  # fmt: skip
    asked = []

    class Client:
        def config(self, operator, shape, dtype, gpu=None):
            asked.append(operator)
            return {"config": served, "source": "exact", "speedup": 2.0}

    kato_torch.configure(client=Client(), policy="kato")
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(1000, 264, device="cuda", generator=gen, dtype=torch.bfloat16)
        b = torch.randn(264, 136, device="cuda", generator=gen, dtype=torch.bfloat16)
        a.requires_grad_(True)
        b.requires_grad_(True)
        c = kato_torch.matmul(a, b)
        c.float().square().sum().backward()
        ref_a, ref_b = a.detach().float().requires_grad_(True), b.detach().float().requires_grad_()
        (ref_a @ ref_b).square().sum().backward()
        torch.cuda.synchronize()
        for got, want in ((c, ref_a @ ref_b), (a.grad, ref_a.grad), (b.grad, ref_b.grad)):
            err = (got.float() - want.float()).norm() / want.float().norm()
            assert err < 2e-2, err
        bound = _kernels.bind("matmul", (1000, 136, 264), "bfloat16", 0)
        assert bound.config["ENGINE"] == "wgmma" and bound.source == "exact"
        assert {"matmul", "matmul_nt", "matmul_tn"} <= set(asked)
        assert len(_kernels._maps) >= 2 + epilogue  # A's, B's (and C's) maps, from the tensors
    finally:
        kato_torch.configure()


# --- float32 split-K clusters (SPLIT_K > 1 on the CUDA-core path, sm_90) ------------------------


def _is_split(config) -> bool:
    return config["ENGINE"] == "mma" and config["SPLIT_K"] > 1


@sm90
@pytest.mark.parametrize("shape", [(130, 67, 3001), (64, 64, 48), (1000, 1001, 999)], **_IDS)
@pytest.mark.parametrize("operator", OPERATORS)
def test_every_float32_split_k_variant_verifies(operator, shape):
    """Every valid float32 config with SPLIT_K 2-4 in each layout: long K (each CTA a range of
    ~60 k tiles), K of exactly 3 k tiles of 16 (a CTA takes one), and issue 31's unaligned
    small GEMM; unaligned rows throughout (VEC 4 loads them element by element). A seeded
    sample of 40 of the 88-186 per case (every tile is in the other sweeps too)."""
    spec = get_operator(operator)
    checked, failures = verify_variants(
        spec, shape, "float32", max_configs=40, seed=5, where=_is_split
    )
    assert checked >= 40
    assert not failures, f"{len(failures)} of {checked} failed: {failures[:5]}"


@sm90
def test_float32_split_k_is_deterministic():
    """The cluster adds its partial sums in rank order, so two runs of a split config agree bit
    for bit (an atomic-add split-K would not), and the result is within float32 rounding of
    the unsplit config's."""
    import torch

    import kato_torch
    from kato_torch import _kernels

    base = {
        "BM": 64, "BN": 64, "BK": 16, "WM": 16, "WN": 32, "TM": 4, "TN": 4, "VEC": 4,
        "STAGES": 2, "PAD": 4, "MIN_BLOCKS": 0, "ENGINE": "mma", "CLUSTER_M": 1,
        "PERSISTENT": 0, "EPILOGUE": 0, "SPLIT_K": 1, "PINGPONG": 0, "STREAM_K": 0,
    }  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(257, 8191, device="cuda", generator=gen)
    b = torch.randn(8191, 193, device="cuda", generator=gen)
    outs = {}
    for split in (1, 3):
        served = {**base, "SPLIT_K": split}

        # (`config` is the method's name in the class body, so the default reads `served`)
        class Client:
            def config(self, operator, shape, dtype, gpu=None, _config=served):
                return {"config": _config, "source": "exact", "speedup": 2.0}

        kato_torch.configure(client=Client(), policy="kato")
        try:
            outs[split] = [kato_torch.matmul(a, b) for _ in range(2)]
            # the served config ran, not the default (SPLIT_K 1) after a refusal
            bound = _kernels.bind("matmul", (257, 193, 8191), "float32", 0)
            assert (bound.config["SPLIT_K"], bound.source) == (split, "exact")
        finally:
            kato_torch.configure()
    torch.cuda.synchronize()
    assert torch.equal(outs[3][0], outs[3][1])
    want = a.double() @ b.double()
    for split in (1, 3):
        err = (outs[split][0].double() - want).abs().max().item()
        assert err < 1e-3 * want.abs().max().item(), (split, err)


# --- stream-K (STREAM_K 1: a CTA per SM on ranges of tiles x k blocks, sm_90) ------------------
#
# Issue 32's shape (72 tiles of 128 x 256 for 132 SMs), and shapes where each part of the
# protocol is at its edge: M, N and K multiples of no tile (1000^3: 8-128 tiles, 16 k blocks);
# ranges of one or two k blocks (1032 x 3080 x 72: 2 k blocks per tile); every range inside one
# tile (120 x 248 x 12792: one 128 x 256 tile of 200 k blocks, each CTA 1-2 of them, 131
# helpers for CTA 0); ranges just over a tile (2056 x 2048 x 264: 136 tiles of 5 k blocks).
# The backend verifies twice on one module: the second call is right only if the first left
# every counter at zero (else its owners would wait past the timeout and trap).

STREAM_K_SHAPE = (768, 3072, 8192)
STREAM_K_SHAPES = [(1000, 1000, 1000), (1032, 3080, 72), (120, 248, 12792), (2056, 2048, 264)]


def _stream_k_configs(spec, shape, dtype):
    return [c for c in _wgmma_configs(spec, shape, dtype) if c["STREAM_K"]]


@sm90
def test_every_stream_k_config_verifies_at_the_issue_shape():
    """Every valid STREAM_K=1 config of bfloat16 matmul_tn at 768 x 3072 x 8192 (14 tile x
    epilogue classes at their stage counts) passes the backend's verification, twice."""
    spec = get_operator("matmul_tn")
    configs = _stream_k_configs(spec, STREAM_K_SHAPE, "bfloat16")
    assert len({(c["BM"], c["BN"], c["EPILOGUE"]) for c in configs}) == 14
    failures = _verify_all(spec, STREAM_K_SHAPE, "bfloat16", configs)
    assert not failures, f"{len(failures)} of {len(configs)} failed: {failures[:3]}"


@sm90
def test_a_stream_k_trial_loads_its_workspace_once_and_close_frees_it():
    """A tensor-map config's cubin is loaded once (through the driver, not also into PyCUDA):
    each loaded STREAM_K=1 config takes one workspace of device memory, and a backend's close
    unloads those modules, so a backend made after it finds the memory free again. It reads
    the device's free memory: run it with no other process on the GPU."""
    from kato.kernels.matmul import stream_k_workspace_bytes
    from kato.tuner.backends.pycuda import PyCudaBackend

    spec, shape = get_operator("matmul_tn"), STREAM_K_SHAPE
    configs = _stream_k_configs(spec, shape, "bfloat16")[:4]
    workspace = max(stream_k_workspace_bytes(c) for c in configs)
    backend = PyCudaBackend(spec, shape, "bfloat16", repeats=1, warmup=0, seed=5)
    try:
        backend.precompile(configs)
        compiled = [backend.compile(c) for c in configs]
        before = backend.memory().free_bytes
        for config, kernel in zip(configs, compiled, strict=True):
            calls = backend.load(kernel, spec.steps(config, shape, "bfloat16"))
            assert backend.verify(calls) is None
        taken = before - backend.memory().free_bytes
    finally:
        backend.close()
    # A module's workspace takes whole 2 MiB pages, its code a page more; loaded twice, a
    # config would take both twice.
    per_module = -(-workspace // (2 << 20)) * (2 << 20) + (2 << 20)
    assert taken <= len(configs) * per_module, (taken, workspace)
    again = PyCudaBackend(spec, shape, "bfloat16", repeats=1, warmup=0, seed=5)
    try:
        assert again.memory().free_bytes >= before - (8 << 20)
    finally:
        again.close()


@sm90
@pytest.mark.parametrize(
    ("operator", "dtype"),
    [(op, "bfloat16") for op in OPERATORS] + [("matmul_tn", "float16")],
)
@pytest.mark.parametrize("shape", STREAM_K_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_stream_k_config_verifies_at_awkward_shapes(operator, dtype, shape):
    spec = get_operator(operator)
    configs = _stream_k_configs(spec, shape, dtype)
    assert {c["EPILOGUE"] for c in configs} == {0, 1}
    if shape == (120, 248, 12792):  # 1-8 tiles of every size: all eight tiles (not 256 x 256)
        assert len({(c["BM"], c["BN"]) for c in configs}) == 8
    failures = _verify_all(spec, shape, dtype, configs)
    assert not failures, f"{len(failures)} of {len(configs)} failed: {failures[:3]}"


@sm90
@pytest.mark.parametrize("epilogue", [0, 1])
def test_stream_k_is_deterministic_and_served_through_kato_torch(epilogue):
    """kato_torch launches a served STREAM_K=1 config (its module holds the workspace, so it
    is loaded per stream); its owners add the partial sums in CTA order, so three calls agree
    bit for bit (each after the last left the counters at zero), within the K-scaled tolerance
    of the float64 product; then a second shape on the same source runs right too."""
    import torch

    import kato_torch
    from kato_torch import _kernels

    served = {
        "BM": 128, "BN": 256, "BK": 64, "WM": 64, "WN": 64, "TM": 4, "TN": 4, "VEC": 8,
        "STAGES": 3, "PAD": 0, "MIN_BLOCKS": 0, "ENGINE": "wgmma", "CLUSTER_M": 1,
        "PERSISTENT": 1, "EPILOGUE": epilogue, "SPLIT_K": 1, "PINGPONG": 0, "STREAM_K": 1,
    }  # fmt: skip
    spec = get_operator("matmul")

    class Client:
        def config(self, operator, shape, dtype, gpu=None):
            return {"config": served, "source": "exact", "speedup": 2.0}

    kato_torch.configure(client=Client(), policy="kato")
    try:
        for m, n, k in [(768, 3072, 8192), (1000, 1000, 1000)]:
            assert spec.check(served, (m, n, k), "bfloat16") is None
            gen = torch.Generator(device="cuda").manual_seed(0)
            a = torch.rand(m, k, device="cuda", generator=gen).sub_(0.5).to(torch.bfloat16)
            b = torch.rand(k, n, device="cuda", generator=gen).sub_(0.5).to(torch.bfloat16)
            outs = [kato_torch.matmul(a, b) for _ in range(3)]
            torch.cuda.synchronize()
            bound = _kernels.bind("matmul", (m, n, k), "bfloat16", 0)
            assert (bound.config["STREAM_K"], bound.source) == (1, "exact")
            assert bound.per_stream  # the workspace is the module's: one per stream
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
            want = a.double() @ b.double()
            atol, rtol = spec.tolerance_for(k, "bfloat16")
            err = (outs[0].double() - want).abs() - rtol * want.abs()
            assert err.max().item() <= atol, err.max().item()
    finally:
        kato_torch.configure()
