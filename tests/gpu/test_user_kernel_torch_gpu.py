"""``kato_torch.user_kernel`` on the GPU: a folder's operator and a 2-D one called on CUDA
tensors under the default policy (a user operator has no PyTorch op, so "auto" runs Kato's
kernel), with configs served by a client, on a side stream, against float64 references at
awkward sizes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="kato_torch needs PyTorch (the GPU image has it)")

from kato.kernels.user import spec_from_folder  # noqa: E402
from user_ops.test_torch_user_kernel import _matmul  # noqa: E402

import kato_torch  # noqa: E402

FOLDER = Path(__file__).resolve().parent.parent / "user_ops" / "data" / "vector_add"


class _Serving:
    """A client serving one config as an exact winner for every key."""

    def __init__(self, config):
        self.config_ = config

    def lookup(self, operator, shape, dtype, gpu=None):
        return SimpleNamespace(config=dict(self.config_), source="exact", speedup=None)


@pytest.fixture(autouse=True)
def _auto():
    kato_torch.configure(client=None)  # the default policy, "auto"
    yield
    kato_torch.configure(client=None)


@pytest.mark.parametrize("n", [1, 31, 1025, 1_000_003])
def test_vector_add_under_auto_matches_float64(n):
    add = kato_torch.user_kernel(spec_from_folder(FOLDER))
    a = torch.randn(n, device="cuda")
    b = torch.randn(n, device="cuda")
    c = add(a, b, n)
    assert c.shape == (n,) and c.dtype == torch.float32
    torch.testing.assert_close(c.double(), a.double() + b.double(), rtol=1e-6, atol=1e-6)
    bound = kato_torch.bind(add.name, (n,), "float32", a.device.index or 0)
    assert bound.source == "default"  # no client: the operator's default config


@pytest.mark.parametrize(
    "config",
    [{"block_size_x": bx, "tile_size_x": t} for bx in (32, 256, 1024) for t in (1, 4)],
)
def test_served_configs_run_on_the_callers_stream(config):
    n = 1_000_003
    kato_torch.configure(client=_Serving(config))
    add = kato_torch.user_kernel(spec_from_folder(FOLDER))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a = torch.randn(n, device="cuda")
        b = torch.randn(n, device="cuda")
        c = add(a, b, n)
        d = c * 2  # ordered after the kernel on the same stream
    side.synchronize()
    assert kato_torch.bind(add.name, (n,), "float32", 0).config == config
    torch.testing.assert_close(d.double(), 2 * (a.double() + b.double()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mnk", [(1, 1, 1), (17, 33, 65), (128, 129, 31), (257, 64, 2)])
def test_a_2d_user_kernel_gives_shaped_outputs(dtype, mnk):
    m, n, k = mnk
    mm = kato_torch.user_kernel(_matmul(f"gpu_torch_user_mm_{str(dtype)[6:]}"))
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    c = mm(a, b, m, n, k)
    assert c.shape == (m, n) and c.dtype == dtype
    want = a.double() @ b.double()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(c.double(), want, rtol=tol, atol=tol * max(1, k) ** 0.5)


def test_constant_memory_arrays_are_uploaded_before_each_call():
    from user_ops.test_constants import FILTER, _op

    conv = kato_torch.user_kernel(_op(name="gpu_torch_user_conv"))
    n = 100_003
    x = torch.randn(n + FILTER - 1, device="cuda")
    window = x.double().unfold(0, FILTER, 1)
    for taps in (torch.randn(FILTER), torch.randn(FILTER, device="cuda")):
        y = conv(x, n, shape=(n, FILTER), constants={"d_filter": taps})
        want = window @ taps.double().to(window.device)
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
