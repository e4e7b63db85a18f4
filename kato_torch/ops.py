"""Differentiable PyTorch functions running Kato's kernels (see the package docstring).

Each function takes CUDA tensors, makes them contiguous, binds the operator for the tensor's
(shape, dtype) once (config lookup + compile, cached) and launches on the current stream.
Argument lists follow each operator spec's ``make_problem`` order.
"""

from __future__ import annotations

import torch

from kato_torch._kernels import bind

_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
}


def _dtype(t: torch.Tensor, operator: str) -> str:
    if not t.is_cuda:
        raise ValueError(f"kato_torch.{operator} needs a CUDA tensor, got one on {t.device}")
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        known = ", ".join(str(d) for d in _DTYPES)
        raise TypeError(f"kato_torch.{operator} does not support {t.dtype}; use {known}") from None


def _rows_cols(x: torch.Tensor) -> tuple[int, int]:
    cols = x.shape[-1] if x.dim() else 1
    return x.numel() // max(cols, 1), cols


# --- softmax ----------------------------------------------------------------------------------


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        dtype = _dtype(x, "softmax")
        x = x.contiguous()
        rows, cols = _rows_cols(x)
        y = torch.empty_like(x)
        bind("softmax", (rows, cols), dtype, x.device.index).run([x, y, rows, cols])
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        y32, dy32 = y.float(), dy.float()
        dx = y32 * (dy32 - (dy32 * y32).sum(dim=-1, keepdim=True))
        return dx.to(y.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim (float32 accumulation), like ``torch.softmax(x, -1)``."""
    return _Softmax.apply(x)


# --- layernorm --------------------------------------------------------------------------------


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float):
        dtype = _dtype(x, "layernorm")
        x = x.contiguous()
        rows, cols = _rows_cols(x)
        if weight.shape != (cols,) or bias.shape != (cols,):
            raise ValueError(f"weight and bias must have shape ({cols},)")
        weight = weight.to(x.dtype).contiguous()
        bias = bias.to(x.dtype).contiguous()
        y = torch.empty_like(x)
        mean = torch.empty(rows, device=x.device, dtype=torch.float32)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        bind("layernorm", (rows, cols), dtype, x.device.index).run(
            [x, weight, bias, y, mean, rstd, rows, cols, float(eps)]
        )
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        # Standard layer-norm backward from the saved per-row statistics (float32 math).
        x, weight, mean, rstd = ctx.saved_tensors
        cols = x.shape[-1]
        x2 = x.reshape(-1, cols).float()
        dy2 = dy.reshape(-1, cols).float()
        xhat = (x2 - mean[:, None]) * rstd[:, None]
        g = dy2 * weight.float()
        dx = rstd[:, None] * (
            g - g.mean(dim=1, keepdim=True) - xhat * (g * xhat).mean(dim=1, keepdim=True)
        )
        dweight = (dy2 * xhat).sum(dim=0)
        dbias = dy2.sum(dim=0)
        return (
            dx.reshape(x.shape).to(x.dtype),
            dweight.to(weight.dtype),
            dbias.to(weight.dtype),
            None,
        )


def layernorm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """Layer norm over the last dim with ``weight`` and ``bias`` (Welford statistics, float32
    accumulation), like ``torch.nn.functional.layer_norm(x, (cols,), weight, bias, eps)``."""
    return _LayerNorm.apply(x, weight, bias, eps)


# --- relu -------------------------------------------------------------------------------------


class _ReLU(torch.autograd.Function):
    """Forward saves what the tuned variant's backward reads: a 1-bit-per-element mask (bitmask
    variant, 1/32 of x's bytes in float32) or x itself (plain variant)."""

    @staticmethod
    def forward(ctx, x):
        dtype = _dtype(x, "relu")
        x = x.contiguous()
        n = x.numel()
        bound = bind("relu", (n,), dtype, x.device.index)
        y = torch.empty_like(x)
        mask = torch.empty((n + 31) // 32, device=x.device, dtype=torch.int32)
        bound.run([x, None, y, mask, None, n], steps=[0])
        ctx.bound = bound
        if bound.config.get("MASK", 1):
            ctx.save_for_backward(mask)
        else:
            ctx.save_for_backward(x)
        ctx.n, ctx.shape = n, x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        (saved,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(dy)
        # The bitmask variant's backward step reads the mask, the plain one's reads x.
        plain = not ctx.bound.config.get("MASK", 1)
        x, mask = (saved, None) if plain else (None, saved)
        ctx.bound.run([x, dy, None, mask, dx, ctx.n], steps=[1])
        return dx


def relu(x: torch.Tensor) -> torch.Tensor:
    """ReLU whose backward reads a 1-bit mask saved by the forward pass (tuned variant)."""
    return _ReLU.apply(x)


# --- transpose --------------------------------------------------------------------------------


def _transpose2d(x: torch.Tensor) -> torch.Tensor:
    dtype = _dtype(x, "transpose")
    if x.dim() != 2:
        raise ValueError(f"kato_torch.transpose takes a 2-D tensor, got {x.dim()} dimensions")
    x = x.contiguous()
    rows, cols = x.shape
    y = torch.empty((cols, rows), device=x.device, dtype=x.dtype)
    bind("transpose", (rows, cols), dtype, x.device.index).run([x, y, rows, cols])
    return y


class _Transpose(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _transpose2d(x)

    @staticmethod
    def backward(ctx, dy):
        return _transpose2d(dy)


def transpose(x: torch.Tensor) -> torch.Tensor:
    """A contiguous transpose of a 2-D tensor, like ``x.t().contiguous()``."""
    return _Transpose.apply(x)


# --- matmul -----------------------------------------------------------------------------------


def _matmul2d(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dtype = _dtype(a, "matmul")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or a.dtype != b.dtype:
        raise ValueError(
            f"kato_torch.matmul takes (M, K) @ (K, N) of one dtype, got "
            f"{tuple(a.shape)} {a.dtype} @ {tuple(b.shape)} {b.dtype}"
        )
    a, b = a.contiguous(), b.contiguous()
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), device=a.device, dtype=a.dtype)
    bind("matmul", (m, n, k), dtype, a.device.index).run([a, b, c, m, n, k])
    return c


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _matmul2d(a, b)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        dc = dc.contiguous()
        da = _matmul2d(dc, _transpose2d(b)) if ctx.needs_input_grad[0] else None
        db = _matmul2d(_transpose2d(a), dc) if ctx.needs_input_grad[1] else None
        return da, db


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C = A @ B for 2-D row-major A (M, K) and B (K, N): float32 on CUDA cores (no TF32),
    float16/bfloat16 on tensor cores with float32 accumulation. Backward uses Kato's matmul and
    transpose."""
    return _Matmul.apply(a, b)
