"""The batchnorm family's compile tests' share of variants rendered with the plane splits
(``PLANE_SPLIT`` / ``APPLY_PLANE_SPLIT``: H*W not a multiple of the vector width, issue 31).

At H*W = 49 every vector width above 1 splits its pass. CI compiles, per (dtype, APPLY, register
cap of the reduction kernels), the split variant whose check() estimate is the highest (the one
nearest to spilling under its cap), and per dtype the split apply kernel (APPLY=0) with the
highest estimate of its own; ``KATO_COMPILE_FULL=1`` every distinct split variant."""

from __future__ import annotations

import os

from compile_harness import Variant, distinct_variants
from kato.kernels import DTYPES
from kato.kernels.batchnorm_stats import register_cap, step_registers

#: ResNet's 7x7 planes: H*W = 49 is a multiple of no vector width above 1.
SPLIT_SHAPE = (16, 64, 7, 7)
FULL = os.environ.get("KATO_COMPILE_FULL") == "1"


def split_pressure(v: Variant) -> int:
    """check()'s register estimate of ``v``'s passes with their plane splits."""
    itemsize = DTYPES[v.dtype][2]
    hw = v.shape[2] * v.shape[3]
    c = v.config
    if not hasattr(v.spec, "reduction_registers"):  # batchnorm_stats
        return step_registers(c, itemsize, hw % c["VEC"] != 0)
    return v.spec.reduction_registers(c, itemsize, hw % c["VEC"] != 0) + v.spec.apply_registers(
        c, itemsize, hw % c["APPLY_VEC"] != 0
    )


def plane_split_sample(spec) -> list[Variant]:
    """The split variants of ``spec`` the compile tests add (see the module's docstring)."""
    every = [
        v
        for v in distinct_variants(spec, [(SPLIT_SHAPE, d) for d in spec.dtypes])
        if {"PLANE_SPLIT", "APPLY_PLANE_SPLIT"} & set(spec.defines(v.config, v.shape, v.dtype))
    ]
    if FULL:
        return every
    heaviest: dict[tuple, tuple[int, Variant]] = {}

    def keep(key: tuple, weight: int, v: Variant) -> None:
        if key not in heaviest or weight > heaviest[key][0]:
            heaviest[key] = (weight, v)

    for v in every:
        keep((v.dtype, v.config.get("APPLY"), register_cap(v.config)), split_pressure(v), v)
        if v.config.get("APPLY") == 0 and "APPLY_PLANE_SPLIT" in v.spec.defines(
            v.config, v.shape, v.dtype
        ):  # the separate apply kernel, under its own cap of 64
            hw = v.shape[2] * v.shape[3]
            weight = v.spec.apply_registers(v.config, DTYPES[v.dtype][2], True)
            keep((v.dtype, "apply kernel", hw), weight, v)
    return [v for _, v in heaviest.values()]


def split_coverage(spec, chosen: list[Variant]) -> tuple[set[tuple[str, int]], set[str]]:
    """Among ``chosen``: the (dtype, register cap of the reduction kernels) pairs whose
    reduction pass renders PLANE_SPLIT, and the dtypes whose elementwise pass renders
    APPLY_PLANE_SPLIT."""
    reduction, apply = set(), set()
    for v in chosen:
        macros = spec.defines(v.config, v.shape, v.dtype)
        if "PLANE_SPLIT" in macros:
            reduction.add((v.dtype, register_cap(v.config)))
        if "APPLY_PLANE_SPLIT" in macros:
            apply.add(v.dtype)
    return reduction, apply
