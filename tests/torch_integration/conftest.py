"""kato_torch on the CPU: the custom operators' schemas, fake and autograd registrations, the
PyTorch paths every operator falls back to, the policy, shape capture and the module swap.
Kato's kernels themselves run in tests/gpu/test_torch_gpu.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="kato_torch's tests need PyTorch (the torch extra)")

import kato_torch  # noqa: E402


@pytest.fixture(autouse=True)
def _no_client():
    kato_torch.configure(client=None)
    yield
    kato_torch.configure(client=None)
