"""Request keys: how a lookup (operator, shape, dtype, GPU) becomes what is asked of the server.

Policies for shapes never tuned:

- ``exact``: only a config tuned for exactly this shape; otherwise the operator's default.
- ``nearest``: the server's rule: this shape, else the nearest tuned shape of the same
  operator, dtype and GPU, else the default.
- ``bucket``: every dimension rounded up to a power of two (1000x3000 -> 1024x4096); the bucket's
  answer (``nearest`` rule, for the bucket shape) serves every shape in the bucket, so a run
  with many shapes asks the server once per bucket. Where the bucket's config is not valid for
  the actual shape (checked with the local operator spec), the actual shape is looked up with
  the ``nearest`` rule instead.
"""

from __future__ import annotations

from typing import Any, Literal

Policy = Literal["exact", "nearest", "bucket"]
POLICIES: tuple[str, ...] = ("exact", "nearest", "bucket")

#: ``(operator, shape, dtype, gpu)`` with a tuple of ints and canonical names.
Key = tuple[str, tuple[int, ...], str, str]
#: ``(operator, shape, dtype, gpu, match)``: one server lookup (``match``: exact or nearest).
RequestKey = tuple[str, tuple[int, ...], str, str, str]


def bucket_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Each dimension rounded up to the next power of two (powers of two stay)."""
    return tuple(1 << (int(d) - 1).bit_length() if d > 1 else 1 for d in shape)


def request_key(key: Key, policy: str) -> RequestKey:
    """What to ask the server first for ``key`` under ``policy``."""
    operator, shape, dtype, gpu = key
    if policy == "exact":
        return (operator, shape, dtype, gpu, "exact")
    if policy == "bucket":
        return (operator, bucket_shape(shape), dtype, gpu, "nearest")
    return (operator, shape, dtype, gpu, "nearest")


def dtype_name(dtype: Any) -> str:
    """``"float16"``, ``torch.float16`` and ``numpy.float16`` all give ``"float16"``."""
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    if isinstance(dtype, type):  # numpy.float16
        return dtype.__name__
    name = getattr(dtype, "name", None)  # numpy.dtype("float16")
    return (name if isinstance(name, str) else str(dtype)).removeprefix("torch.")


def shape_tuple(shape: Any) -> tuple[int, ...]:
    """A shape as a tuple of ints; an int is a rank-1 shape; ``"4096x4096"`` is parsed.

    Raises:
        ValueError: a dimension is not a positive integer.
    """
    if isinstance(shape, int):
        dims: tuple[int, ...] = (shape,)
    elif isinstance(shape, str):
        dims = tuple(int(p) for p in shape.replace("x", ",").replace("X", ",").split(",") if p)
    else:
        dims = tuple(int(d) for d in shape)
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"a shape needs positive dimensions, got {shape!r}")
    return dims


def config_valid(operator: str, version: str | None, config: dict[str, Any], key: Key) -> bool:
    """Whether ``config`` (of operator version ``version``) is valid for ``key``'s shape, by the
    local operator spec. ``False`` when that cannot be told (no such local operator, another
    version): the caller then asks the server about the actual shape."""
    try:
        from kato.kernels import get_operator

        spec = get_operator(operator)
        if version is not None and spec.version != version:
            return False
        return spec.check(dict(config), list(key[1]), key[2]) is None
    except Exception:  # unknown operator, a config of another space, an import problem
        return False
