"""Compile every variant of an operator for several archs, fast: batched, deduplicated, parallel.

A standalone nvcc run costs ~0.7 s, mostly start-up and parsing the CUDA headers. The harness
therefore puts ``batch`` variants into one translation unit: each variant's macros, then the
template with its ``extern "C"`` kernels renamed (``#define layernorm_fwd layernorm_fwd_7``) and
its helper namespace renamed (``#define KATO_NS kato_ns_7``), then ``#undef`` of every macro the
variant and the template define. ptxas reports and allocates registers per entry function, so
each variant's resources are what a standalone compile gives (softmax's compile test checks that
on a sample). Variants are deduplicated by rendered source, so parameters that do not change the
code (shape-independent sources) cost nothing.

Template conventions this relies on (every operator in ``kernels/`` follows them):

- device helpers live in ``namespace KATO_NS { ... }``, with ``#ifndef KATO_NS`` /
  ``#define KATO_NS kato_<operator>`` / ``#endif`` at the top of the template;
- every entry point is ``extern "C" __global__`` and listed in ``spec.kernel_names``;
- no ``#pragma once`` and no file-scope ``static`` objects outside ``KATO_NS``;
- the shared helpers of ``kernels/common`` are included inside ``KATO_NS`` (no include guard,
  inlined by ``render``), so every variant of a batch gets its own copy.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import random
import re
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kato.kernels.spec import Config, OperatorSpec
from kato.tuner.backends.pycuda import operator_space
from kato.tuner.nvcc import CompiledKernel, CompileError, KernelResources, compile_many

_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)", re.MULTILINE)

#: The archs the compile tests build for; the first one takes the whole sample, the others every
#: other variant of it (all of it with :data:`FULL`).
ARCHS = tuple(os.environ.get("KATO_COMPILE_TEST_ARCHS", "sm_90,sm_80").split(","))
#: nvcc processes at once (CI runners have 2 cores; the device host's session sets 16).
WORKERS = int(os.environ.get("KATO_COMPILE_WORKERS") or 2)
#: ``KATO_COMPILE_FULL=1`` compiles every distinct variant (the device host's session does, on
#: 16 cores); otherwise the compile tests take :func:`covering_sample`, which a cold run on CI's
#: 2 cores affords.
FULL = os.environ.get("KATO_COMPILE_FULL") == "1"
#: The archs of a fused variant's compile test (an epilogue on a template that its own compile
#: test builds for every arch of :data:`ARCHS`): the first alone in CI, all of them with
#: :data:`FULL` or ``KATO_COMPILE_TEST_ARCHS``.
FUSED_ARCHS = ARCHS if FULL or "KATO_COMPILE_TEST_ARCHS" in os.environ else ARCHS[:1]
#: The ``pairs`` argument of :func:`covering_sample` that the ``sample_pairs`` fixture
#: (tests/kernels/conftest.py) hands a compile module's fixtures: every value in the default
#: run, every pair of values as well under ``-m slow`` (the default run's sample until
#: 2026-12-07; docs/ARCHITECTURE.md has the figures).
SAMPLES = [False, pytest.param(True, marks=pytest.mark.slow)]
SAMPLE_IDS = ["values", "pairs"]


def kernel_names(spec: OperatorSpec) -> tuple[str, ...]:
    """Every entry point of the operator (``spec.kernel_names`` or just the main kernel)."""
    return tuple(getattr(spec, "kernel_names", None) or (spec.kernel_name,))


def variant_kernels(variant: Variant) -> tuple[str, ...]:
    """The entry points of the operator that the variant's source defines (an operator whose
    configs choose between templates has some kernels in each)."""
    source = variant.source()
    return tuple(n for n in kernel_names(variant.spec) if re.search(rf"\b{n}\s*\(", source))


def variant_resources(
    variant: Variant, result: CompiledKernel, suffix: str = ""
) -> dict[str, KernelResources]:
    """The ptxas report of each of :func:`variant_kernels` in ``result`` (its names plus
    ``suffix``). A kernel the source defines under a condition the config leaves out (a split
    row's stats kernel) is absent from the cubin and skipped, unless the variant's steps launch
    it: then its absence is an error (KeyError)."""
    launched = {s.kernel for s in variant.spec.steps(variant.config, variant.shape, variant.dtype)}
    present = {entry.name for entry in result.entries}
    return {
        n: result.resources(f"{n}{suffix}")
        for n in variant_kernels(variant)
        if n in launched or f"{n}{suffix}" in present
    }


@dataclass(frozen=True)
class Variant:
    """One config of one operator at one shape and dtype."""

    spec: OperatorSpec
    config: Config
    shape: tuple[int, ...]
    dtype: str

    def source(self) -> str:
        return self.spec.render(self.config, self.shape, self.dtype)

    def __str__(self) -> str:
        return f"{self.spec.name} {self.dtype} {self.shape} {self.config}"


@dataclass
class Outcome:
    """Compile result of one variant on one arch: resources per entry point, or an error."""

    variant: Variant
    arch: str
    resources: dict[str, KernelResources] = field(default_factory=dict)
    error: str | None = None


def distinct_variants(
    spec: OperatorSpec,
    cases: Iterable[tuple[Sequence[int], str]],
    candidates: Callable[[str], Sequence[Config]] | None = None,
) -> list[Variant]:
    """Every valid config of every (shape, dtype) case, one per distinct rendered source.
    Enumerated as the backends do (``operator_space``: the spec's ``candidates`` where it lists
    them; walking matmul's whole product of 12 million takes minutes a case), or from
    ``candidates(dtype)`` where given (a spec whose listing does not depend on the shape, listed
    once for every case). Valid configs are kept per (spec, shape, dtype) for the process."""
    seen: set[Hashable] = set()
    found = []
    for shape, dtype in cases:
        shape = tuple(shape)
        if candidates is None:
            valid = _valid_configs(spec, shape, dtype)
        else:
            valid = [c for c in candidates(dtype) if spec.check(c, shape, dtype) is None]
        for config in [*valid, spec.default_config(shape, dtype)]:
            variant = Variant(spec, dict(config), shape, dtype)
            key = _source_key(variant)
            if key not in seen:
                seen.add(key)
                found.append(variant)
    return found


@functools.cache
def _valid_configs(spec: OperatorSpec, shape: tuple[int, ...], dtype: str) -> tuple[Config, ...]:
    space = operator_space(spec, shape, dtype, lambda c: spec.check(c, shape, dtype))
    return tuple(space.valid_configs())


def _source_key(v: Variant) -> Hashable:
    """Equal for two variants exactly when their rendered sources are. ``OperatorSpec.render``
    is the ``#define`` lines of ``defines`` then the config's template, so those stand for the
    source (rendering inlines the shared headers: batchnorm's 68,000 valid configs took a
    minute); a spec that renders otherwise is hashed in full."""
    if type(v.spec).render is not OperatorSpec.render:
        return hashlib.sha256(v.source().encode()).hexdigest()
    defines = tuple(
        (k, str(value)) for k, value in v.spec.defines(v.config, v.shape, v.dtype).items()
    )
    return v.spec.template_for(v.config), defines


def _features(v: Variant, shapes: dict[tuple[int, ...], int], pairs: bool) -> set[tuple]:
    """What a variant exercises: its dtype, shape and every parameter's value, each of those
    with the dtype (or, where ``pairs``, every pair of them), and each macro the spec renders
    for it (derived switches such as a split row)."""
    axes = [("dtype", v.dtype), ("shape", shapes[v.shape]), *sorted(v.config.items())]
    found: set[tuple] = set(axes)
    if pairs:
        found.update(itertools.combinations(axes, 2))
    else:
        found.update((axes[0], axis) for axis in axes[1:])
    for name, value in v.spec.defines(v.config, v.shape, v.dtype).items():
        found.add(("define", name, str(value)))
    return found


def covering_sample(
    variants: Sequence[Variant],
    *,
    heaviest: Callable[[Variant], tuple[Hashable, float] | None] | None = None,
    seed: int = 2026,
    full: bool | None = None,
    pairs: bool = False,
) -> list[Variant]:
    """The variants a compile test compiles: every one where ``full`` (default
    :data:`FULL`), else a covering sample, in a seeded order, of each variant that reaches
    something none before it did: a value of the shape or a parameter in a dtype (every
    value in every dtype), a rendered macro's value, and where ``pairs`` (the ``-m slow``
    sample, :data:`SAMPLES`) any pair of values (every two parameters' values meet at least
    once). ``heaviest(v)`` -> ``(key, score)`` adds, per key, the variant of highest score:
    the module's resource boundary (the most registers a launch bound must hold), which
    values or pairs alone would reach only by chance. Typically 3-10% of a space's sources
    with pairs, about two thirds of that without; the full set is compiled on the device
    host (``KATO_COMPILE_FULL=1``)."""
    if full is None:
        full = FULL
    if full:
        return list(variants)
    shapes = {shape: i for i, shape in enumerate(dict.fromkeys(v.shape for v in variants))}
    order = list(variants)
    random.Random(seed).shuffle(order)
    chosen, covered = [], set()
    for v in order:
        features = _features(v, shapes, pairs)
        if not features <= covered:
            covered |= features
            chosen.append(v)
    if heaviest is not None:
        best: dict[Hashable, tuple[float, int]] = {}
        for i, v in enumerate(order):
            scored = heaviest(v)
            if scored is not None and scored[1] > best.get(scored[0], (float("-inf"), -1))[0]:
                best[scored[0]] = (scored[1], i)
        taken = {id(v) for v in chosen}
        chosen += [order[i] for _, i in best.values() if id(order[i]) not in taken]
    return chosen


def batch_source(batch: Sequence[Variant]) -> str:
    """One translation unit holding every variant of ``batch``; variant i's kernels are
    renamed ``<name>_<i>``."""
    parts = []
    for i, variant in enumerate(batch):
        spec = variant.spec
        names = kernel_names(spec)
        source = variant.source()
        parts += [f"#define {name} {name}_{i}" for name in names]
        parts += [f"#define KATO_NS kato_ns_{i}", source]
        macros = set(_DEFINE.findall(source)) | set(names) | {"KATO_NS"}
        parts += [f"#undef {name}" for name in sorted(macros)]
    return "\n".join(parts) + "\n"


def compile_variants(
    variants: Sequence[Variant],
    archs: Sequence[str],
    cache_dir: Path,
    *,
    batch: int = 48,
    workers: int = WORKERS,
) -> list[Outcome]:
    """Compile ``variants`` for every arch in batches; a failing batch is recompiled variant by
    variant so that the culprits are named. Returns one outcome per (variant, arch)."""
    jobs: list[tuple[str, list[Variant]]] = []
    for arch in archs:
        jobs += [(arch, list(variants[i : i + batch])) for i in range(0, len(variants), batch)]
    requests = [
        (batch_source(b), f"{b[0].spec.main_kernel(b[0].config)}_0", arch, ()) for arch, b in jobs
    ]
    outcomes: list[Outcome] = []
    results = compile_many(requests, max_workers=workers, cache_dir=cache_dir)
    for (arch, chunk), result in zip(jobs, results, strict=True):
        if isinstance(result, CompileError):
            outcomes += _one_by_one(chunk, arch, cache_dir, workers)
            continue
        for i, variant in enumerate(chunk):
            outcomes.append(Outcome(variant, arch, variant_resources(variant, result, f"_{i}")))
    return outcomes


def _one_by_one(chunk: list[Variant], arch: str, cache_dir: Path, workers: int) -> list[Outcome]:
    requests = [(v.source(), v.spec.main_kernel(v.config), arch, ()) for v in chunk]
    found = []
    for variant, result in zip(chunk, compile_many(requests, workers, cache_dir), strict=True):
        if isinstance(result, CompileError):
            found.append(Outcome(variant, arch, error=f"{result}\n{result.log[:1500]}"))
        else:
            found.append(Outcome(variant, arch, variant_resources(variant, result)))
    return found


def with_every_value(
    chosen: list[Variant], every: Sequence[Variant], keys: Sequence[str]
) -> list[Variant]:
    """``chosen`` plus, in ``every``'s order, each variant that brings a value of one of
    ``keys`` in a dtype that no variant chosen before it has (e.g. each ``VEC`` per dtype)."""
    chosen = list(chosen)
    seen = {(v.dtype, k, v.config[k]) for v in chosen for k in keys}
    for v in every:
        new = {(v.dtype, k, v.config[k]) for k in keys} - seen
        if new:
            seen |= new
            chosen.append(v)
    return chosen


def sample_with_extra(
    variants: Sequence[Variant],
    *,
    heaviest: Callable[[Variant], tuple[Hashable, float] | None] | None = None,
    extra: Sequence[Variant] = (),
    pairs: bool = False,
) -> list[Variant]:
    """What :func:`compile_covering` compiles: :func:`covering_sample` of ``variants``, then
    each of ``extra`` (defaults of awkward shapes, always compiled) whose source is new."""
    chosen = covering_sample(variants, heaviest=heaviest, pairs=pairs)
    seen = {v.source() for v in chosen}
    for v in extra:
        if v.source() not in seen:
            seen.add(v.source())
            chosen.append(v)
    return chosen


def compile_covering(
    name: str,
    variants: Sequence[Variant],
    cache_dir: Path,
    *,
    heaviest: Callable[[Variant], tuple[Hashable, float] | None] | None = None,
    extra: Sequence[Variant] = (),
    batch: int = 48,
    archs: Sequence[str] = ARCHS,
    pairs: bool = False,
) -> list[Outcome]:
    """Compile :func:`sample_with_extra` of ``variants`` and ``extra`` for ``archs[0]``, and
    every other one of them for the other archs (all with :data:`FULL`). Prints what it
    compiled and how long it took."""
    chosen = sample_with_extra(variants, heaviest=heaviest, extra=extra, pairs=pairs)
    start = time.perf_counter()
    outcomes = compile_variants(chosen, archs[:1], cache_dir, batch=batch)
    rest = (chosen if FULL else chosen[::2]) if archs[1:] else []
    if rest:
        outcomes += compile_variants(rest, archs[1:], cache_dir, batch=batch)
    print(
        f"\n{name}: {len(chosen)} of {len(variants) + len(extra)} variants on {archs[0]}, "
        f"{len(rest)} on {','.join(archs[1:]) or '-'} in {time.perf_counter() - start:.0f} s"
    )
    return outcomes
