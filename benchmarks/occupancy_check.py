"""Kato's occupancy calculator against the CUDA driver's, on the GPU this runs on.

Builds a family of 62 probe kernels (12 to 255 registers per thread through unrolled
accumulators, ``-maxrregcount`` and ``__launch_bounds__``; static shared memory from 0 to 48 KiB),
loads each cubin with the driver API and asks ``cuOccupancyMaxActiveBlocksPerMultiprocessor`` for
block sizes 32..1024 and dynamic shared memory from 0 to the opt-in maximum (and one byte past
it), some with a shared-memory carveout preference set on the function. Every answer is compared
with :func:`tuner.occupancy.occupancy` fed the driver's own register and static-shared counts.
It also compares the catalog entry with the device's attributes, and records
``cuOccupancyAvailableDynamicSMemPerBlock`` next to :func:`tuner.occupancy.max_dynamic_shared_for`
(informational: that one is not counted as a disagreement).

    python benchmarks/occupancy_check.py [--out PATH] [--device 0] [--cache-dir DIR]
    python benchmarks/occupancy_check.py --compile-only   # no GPU: build the probes, list them

Writes a JSON table (default ``$OUT/occupancy_<model>.json``, or ``./occupancy_<model>.json``
without ``$OUT``) whose ``rows`` hold ``name, threads_per_block, registers, shared_static_bytes,
dynamic_shared_bytes, carveout, driver_blocks_per_sm, kato_blocks_per_sm``; copied to
``tests/tuner/data/occupancy_h200.json`` it becomes the table the CPU tests check against.
Prints a summary; exits 1 if any row disagrees, the catalog contradicts the device, or a probe
could not be built or asked about. A driver error from the occupancy call itself is recorded
(``driver_error``) as 0 blocks: the configuration cannot launch.

The driver is called through ctypes on ``libcuda.so.1``, not PyCUDA: PyCUDA's ``Function`` has no
occupancy call and does not expose its ``CUfunction`` handle, so a kernel loaded by PyCUDA cannot
be handed to the driver's occupancy API. Needs nvcc and a CUDA driver; no PyCUDA, no PyTorch.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kato.tuner.nvcc import CompiledKernel, CompileError, CompileJob, compile_many  # noqa: E402
from kato.tuner.occupancy import max_dynamic_shared_for, occupancy  # noqa: E402

from kato.shared.gpus import (  # noqa: E402
    GpuSpec,
    find_gpu,
    normalize_gpu_name,
    spec_for_compute_capability,
)

KERNEL_NAME = "occ_probe"

# One template; the macros set register pressure (NACC live accumulators), static shared memory
# and launch bounds. Every accumulator stays live across the runtime-length loop, so ptxas cannot
# fold them away; -maxrregcount or the launch bounds then cap the count (spilling the rest).
PROBE_SOURCE = r"""
#ifndef NACC
#define NACC 8
#endif
#ifndef STATIC_BYTES
#define STATIC_BYTES 0
#endif
#ifdef MAX_THREADS
#define BOUNDS __launch_bounds__(MAX_THREADS, MIN_BLOCKS)
#else
#define BOUNDS
#endif

extern "C" __global__ void BOUNDS
occ_probe(float* __restrict__ out, const float* __restrict__ in, int n, int iters, int dyn_floats)
{
    extern __shared__ float dyn[];
#if STATIC_BYTES > 0
    __shared__ float stat[STATIC_BYTES / 4];
#endif
    const int tid = blockIdx.x * blockDim.x + threadIdx.x;
    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = in[(tid * NACC + i) % n];
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < NACC; ++i) acc[i] = fmaf(acc[i], acc[(i + 1) % NACC], 0.5f);
    }
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < NACC; ++i) s += acc[i];
#if STATIC_BYTES > 0
    stat[threadIdx.x % (STATIC_BYTES / 4)] = s;
#endif
    if (dyn_floats > 0) dyn[threadIdx.x % dyn_floats] = s;
    __syncthreads();
#if STATIC_BYTES > 0
    s += stat[(threadIdx.x + 1) % (STATIC_BYTES / 4)];
#endif
    if (dyn_floats > 0) s += dyn[(threadIdx.x + 1) % dyn_floats];
    if (tid < n) out[tid] = s;
}
"""

#: Block sizes tried (those above a variant's launch bound are skipped); 100, 250 and 800 are
#: not multiples of the warp size on purpose.
BLOCK_SIZES = (32, 64, 96, 100, 128, 160, 192, 250, 256, 288, 320, 384, 448, 512, 640, 768)
BLOCK_SIZES += (800, 896, 992, 1024)
#: Dynamic shared memory tried with every block size (0) and with a few (20000 B), and the sweep
#: tried on a few block sizes of the shared-memory variants ("max": the opt-in maximum; "over":
#: one byte more than that).
DYNAMIC_SOME_BLOCK_SIZES = (64, 128, 256, 512, 1024)
DYNAMIC_SWEEP: tuple[int | str, ...] = (1, 100, 1000, 3000, 6000, 7000, 12000, 29000, 47000)
DYNAMIC_SWEEP += (50000, 64000, 80000, 100000, 116000, 150000, 200000, "max", "over")
SWEEP_BLOCK_SIZES = (64, 128, 256, 1024)
#: Carveout preferences (percent) set on a few variants.
CARVEOUTS = (0, 10, 25, 50, 75, 100)
CARVEOUT_DYNAMIC = (0, 1000, 8000, 30000, 70000, 120000)
CARVEOUT_BLOCK_SIZES = (64, 256)


@dataclass(frozen=True)
class Variant:
    """One probe build: macro values and nvcc options."""

    name: str
    nacc: int = 8
    static_bytes: int = 0
    max_threads: int | None = None  # __launch_bounds__(max_threads, min_blocks) when set
    min_blocks: int = 1
    maxrregcount: int | None = None
    shared_sweep: bool = False  # also sweep dynamic shared memory
    carveouts: bool = False  # also try carveout preferences

    def source(self) -> str:
        defines = f"#define NACC {self.nacc}\n#define STATIC_BYTES {self.static_bytes}\n"
        if self.max_threads is not None:
            defines += (
                f"#define MAX_THREADS {self.max_threads}\n#define MIN_BLOCKS {self.min_blocks}\n"
            )
        return defines + PROBE_SOURCE

    def options(self) -> tuple[str, ...]:
        return (f"-maxrregcount={self.maxrregcount}",) if self.maxrregcount else ()


def variants() -> list[Variant]:
    """The probe family: > 60 builds spanning registers, launch bounds and static shared memory."""
    out: list[Variant] = []
    # Natural register pressure (no cap).
    for nacc in (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 96, 128, 160, 200):
        out.append(
            Variant(f"nacc{nacc}", nacc=nacc, shared_sweep=nacc in (1, 64), carveouts=nacc == 8)
        )
    # High pressure capped by -maxrregcount (the rest spills).
    for cap in (24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 112, 128, 144, 168, 192, 208, 232, 255):
        out.append(Variant(f"nacc256_maxrreg{cap}", nacc=256, maxrregcount=cap))
    # High pressure capped by __launch_bounds__(threads, min blocks).
    bounds = [(1024, 1), (1024, 2), (768, 1), (640, 1), (512, 1), (512, 2), (512, 3), (384, 1)]
    bounds += [(256, 1), (256, 2), (256, 4), (256, 6), (128, 1), (128, 8), (96, 1), (64, 1)]
    for threads, blocks in bounds:
        name = f"nacc256_lb{threads}x{blocks}"
        out.append(Variant(name, nacc=256, max_threads=threads, min_blocks=blocks))
    # Static shared memory (sizes not multiples of 128 included), with dynamic sweeps.
    for static in (1000, 4096, 8200, 12288, 20480, 33000, 40000, 49152):
        name = f"nacc8_static{static}"
        carveouts = static in (1000, 12288)
        out.append(Variant(name, static_bytes=static, shared_sweep=True, carveouts=carveouts))
    for static in (4096, 24576, 49152):
        name = f"nacc64_static{static}"
        carveouts = static == 24576
        out.append(
            Variant(name, nacc=64, static_bytes=static, shared_sweep=True, carveouts=carveouts)
        )
    for static in (16384, 49152):
        name = f"nacc256_lb256x2_static{static}"
        bounded = {"max_threads": 256, "min_blocks": 2}
        out.append(Variant(name, nacc=256, static_bytes=static, shared_sweep=True, **bounded))
    return out


# --- the CUDA driver, through ctypes -----------------------------------------------------------

CU_DEVICE_ATTRIBUTES = {
    "max_threads_per_block": 1,
    "shared_per_block_bytes": 8,
    "warp_size": 10,
    "max_registers_per_block": 12,
    "clock_khz": 13,
    "sm_count": 16,
    "memory_clock_khz": 36,
    "memory_bus_width_bits": 37,
    "l2_bytes": 38,
    "max_threads_per_sm": 39,
    "cc_major": 75,
    "cc_minor": 76,
    "shared_per_sm_bytes": 81,
    "registers_per_sm": 82,
    "shared_per_block_optin_bytes": 97,
    "max_blocks_per_sm": 106,
    "shared_reserved_per_block_bytes": 111,
}
#: Catalog fields that must equal the device attribute of the same name.
CATALOG_EXACT = (
    "sm_count",
    "max_threads_per_block",
    "max_threads_per_sm",
    "max_blocks_per_sm",
    "warp_size",
    "registers_per_sm",
    "max_registers_per_block",
    "shared_per_block_bytes",
    "shared_per_sm_bytes",
    "shared_per_block_optin_bytes",
    "shared_reserved_per_block_bytes",
    "l2_bytes",
)
FUNC_MAX_THREADS_PER_BLOCK = 0
FUNC_SHARED_SIZE_BYTES = 1
FUNC_LOCAL_SIZE_BYTES = 3
FUNC_NUM_REGS = 4
FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
FUNC_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


class DriverError(RuntimeError):
    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name


class Driver:
    """The few driver API calls this check needs, on the primary context of one device."""

    def __init__(self, device_index: int = 0) -> None:
        self.lib = lib = ctypes.CDLL("libcuda.so.1")
        vp, c_int, c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        ptr = ctypes.POINTER
        signatures: dict[str, list[Any]] = {
            "cuInit": [ctypes.c_uint],
            "cuDriverGetVersion": [ptr(c_int)],
            "cuDeviceGet": [ptr(c_int), c_int],
            "cuDeviceGetName": [ctypes.c_char_p, c_int, c_int],
            "cuDeviceGetAttribute": [ptr(c_int), c_int, c_int],
            "cuDeviceTotalMem_v2": [ptr(c_size_t), c_int],
            "cuDevicePrimaryCtxRetain": [ptr(vp), c_int],
            "cuDevicePrimaryCtxRelease_v2": [c_int],
            "cuCtxSetCurrent": [vp],
            "cuModuleLoadData": [ptr(vp), ctypes.c_char_p],
            "cuModuleUnload": [vp],
            "cuModuleGetFunction": [ptr(vp), vp, ctypes.c_char_p],
            "cuFuncGetAttribute": [ptr(c_int), c_int, vp],
            "cuFuncSetAttribute": [vp, c_int, c_int],
            "cuOccupancyMaxActiveBlocksPerMultiprocessor": [ptr(c_int), vp, c_int, c_size_t],
            "cuOccupancyAvailableDynamicSMemPerBlock": [ptr(c_size_t), vp, c_int, c_int],
            "cuGetErrorName": [c_int, ptr(ctypes.c_char_p)],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, c_int
        self._call("cuInit", 0)
        dev = c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), device_index)
        self.device = dev.value
        self.context = vp()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self.context), self.device)
        self._call("cuCtxSetCurrent", self.context)

    def _call(self, name: str, *args: Any) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(text))
            raise DriverError(name, code, (text.value or b"?").decode())

    def close(self) -> None:
        self._call("cuDevicePrimaryCtxRelease_v2", self.device)

    # device
    def name(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self._call("cuDeviceGetName", buf, 256, self.device)
        return buf.value.decode()

    def attribute(self, attr: int) -> int:
        value = ctypes.c_int()
        self._call("cuDeviceGetAttribute", ctypes.byref(value), attr, self.device)
        return value.value

    def total_memory(self) -> int:
        value = ctypes.c_size_t()
        self._call("cuDeviceTotalMem_v2", ctypes.byref(value), self.device)
        return value.value

    def version(self) -> int:
        value = ctypes.c_int()
        self._call("cuDriverGetVersion", ctypes.byref(value))
        return value.value

    # modules and functions
    def load(self, cubin: bytes, kernel_name: str) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        self._call("cuModuleLoadData", ctypes.byref(module), cubin)
        self._call("cuModuleGetFunction", ctypes.byref(func), module, kernel_name.encode())
        return module, func

    def unload(self, module: ctypes.c_void_p) -> None:
        self._call("cuModuleUnload", module)

    def func_attribute(self, func: ctypes.c_void_p, attr: int) -> int:
        value = ctypes.c_int()
        self._call("cuFuncGetAttribute", ctypes.byref(value), attr, func)
        return value.value

    def set_func_attribute(self, func: ctypes.c_void_p, attr: int, value: int) -> None:
        self._call("cuFuncSetAttribute", func, attr, value)

    def max_active_blocks(self, func: ctypes.c_void_p, block: int, dynamic: int) -> int:
        value = ctypes.c_int()
        self._call(
            "cuOccupancyMaxActiveBlocksPerMultiprocessor", ctypes.byref(value), func, block, dynamic
        )
        return value.value

    def available_dynamic(self, func: ctypes.c_void_p, blocks: int, block: int) -> int:
        value = ctypes.c_size_t()
        self._call(
            "cuOccupancyAvailableDynamicSMemPerBlock", ctypes.byref(value), func, blocks, block
        )
        return value.value


# --- the check ---------------------------------------------------------------------------------


@dataclass
class Loaded:
    """A probe loaded on the device, with the driver's view of its resources."""

    variant: Variant
    compiled: CompiledKernel
    module: ctypes.c_void_p
    func: ctypes.c_void_p
    registers: int = 0
    shared_static_bytes: int = 0
    local_bytes: int = 0
    max_threads_per_block: int = 0
    seen: set[tuple[int, int, int | None]] = field(default_factory=set)


def device_description(driver: Driver) -> dict[str, Any]:
    attrs = {key: driver.attribute(code) for key, code in CU_DEVICE_ATTRIBUTES.items()}
    name = driver.name()
    return {
        "name": name,
        "model": normalize_gpu_name(name),
        "compute_capability": [attrs["cc_major"], attrs["cc_minor"]],
        "driver_version": driver.version(),
        "total_memory_bytes": driver.total_memory(),
        # double data rate: bytes/s = 2 * clock * bus width / 8
        "memory_bandwidth_gbs_from_clocks": round(
            2 * attrs["memory_clock_khz"] * 1e3 * attrs["memory_bus_width_bits"] / 8 / 1e9, 1
        ),
        "attributes": attrs,
    }


def catalog_check(gpu: GpuSpec, device: dict[str, Any]) -> list[dict[str, Any]]:
    attrs = device["attributes"]
    checks = [
        {"field": key, "catalog": getattr(gpu, key), "device": attrs[key]} for key in CATALOG_EXACT
    ]
    checks.append(
        {
            "field": "compute_capability",
            "catalog": list(gpu.compute_capability),
            "device": device["compute_capability"],
        }
    )
    for check in checks:
        check["ok"] = check["catalog"] == check["device"]
    return checks


def dynamic_sizes(loaded: Loaded, gpu: GpuSpec, block: int) -> list[int]:
    sizes = [0, 20000] if block in DYNAMIC_SOME_BLOCK_SIZES else [0]
    if loaded.variant.shared_sweep and block in SWEEP_BLOCK_SIZES:
        room = gpu.shared_per_block_optin_bytes - loaded.shared_static_bytes
        for d in DYNAMIC_SWEEP:
            sizes.append(room if d == "max" else room + 1 if d == "over" else int(d))
    return sorted(set(sizes))


def query(
    driver: Driver, loaded: Loaded, gpu: GpuSpec, block: int, dynamic: int, carveout: int | None
) -> dict[str, Any] | None:
    """One row: the driver's and Kato's blocks per SM for one launch configuration."""
    key = (block, dynamic, carveout)
    if key in loaded.seen:
        return None
    loaded.seen.add(key)
    # Opt in to exactly what the launch needs (the default, 48 KiB - static, when that is
    # enough); past the opt-in maximum the attribute stays at the maximum and the launch asks
    # for more, which the driver must refuse.
    room = gpu.shared_per_block_optin_bytes - loaded.shared_static_bytes
    default_room = max(gpu.shared_per_block_bytes - loaded.shared_static_bytes, 0)
    row: dict[str, Any] = {
        "name": loaded.variant.name,
        "threads_per_block": block,
        "registers": loaded.registers,
        "shared_static_bytes": loaded.shared_static_bytes,
        "dynamic_shared_bytes": dynamic,
        "carveout": carveout,
    }
    try:
        opt_in = min(max(dynamic, default_room), room)
        driver.set_func_attribute(loaded.func, FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, opt_in)
    except DriverError as exc:  # not the occupancy call: the row is unusable, not a 0
        row["driver_blocks_per_sm"] = None
        row["setup_error"] = str(exc)
    else:
        try:
            row["driver_blocks_per_sm"] = driver.max_active_blocks(loaded.func, block, dynamic)
        except DriverError as exc:  # the driver refusing the configuration: 0 blocks
            row["driver_blocks_per_sm"] = 0
            row["driver_error"] = exc.name
    occ = occupancy(
        gpu,
        block,
        loaded.registers,
        loaded.shared_static_bytes + dynamic,
        "max" if carveout is None else carveout,
    )
    row["kato_blocks_per_sm"] = occ.blocks_per_sm
    return row


def agrees(row: dict[str, Any]) -> bool | None:
    """Whether driver and Kato agree on a row; None when the driver could not be asked."""
    driver_blocks = row["driver_blocks_per_sm"]
    return None if driver_blocks is None else driver_blocks == row["kato_blocks_per_sm"]


def available_dynamic_rows(driver: Driver, loaded: Loaded, gpu: GpuSpec) -> list[dict[str, Any]]:
    """cuOccupancyAvailableDynamicSMemPerBlock vs max_dynamic_shared_for (informational)."""
    room = gpu.shared_per_block_optin_bytes - loaded.shared_static_bytes
    driver.set_func_attribute(loaded.func, FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, room)
    rows = []
    block = 128
    for blocks in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32):
        row: dict[str, Any] = {
            "name": loaded.variant.name,
            "threads_per_block": block,
            "blocks_per_sm": blocks,
            "shared_static_bytes": loaded.shared_static_bytes,
        }
        try:
            value = driver.available_dynamic(loaded.func, blocks, block)
            row["driver_dynamic_bytes"] = value
            # Does the driver's own answer reach the occupancy it was asked for?
            row["driver_value_reaches"] = (
                driver.max_active_blocks(loaded.func, block, value) >= blocks
            )
        except DriverError as exc:
            row["driver_error"] = exc.name
        row["kato_dynamic_bytes"] = max_dynamic_shared_for(gpu, blocks, loaded.shared_static_bytes)
        rows.append(row)
    return rows


def compile_variants(
    arch: str, cache_dir: Path | None
) -> tuple[list[tuple[Variant, CompiledKernel]], list[dict[str, str]]]:
    all_variants = variants()
    jobs = [CompileJob(v.source(), KERNEL_NAME, arch, v.options()) for v in all_variants]
    built, failed = [], []
    for variant, result in zip(all_variants, compile_many(jobs, cache_dir=cache_dir), strict=True):
        if isinstance(result, CompileError):
            failed.append({"name": variant.name, "error": str(result)})
        else:
            built.append((variant, result))
    return built, failed


def default_out(model: str) -> Path:
    slug = re.sub(r"[^0-9a-z]+", "_", model.lower()).strip("_")
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path.cwd()
    return base / f"occupancy_{slug}.json"


def write_table(path: Path, table: dict[str, Any]) -> None:
    """JSON with one row per line: diffable, and small enough to commit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["{"]
    items = list(table.items())
    for i, (key, value) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        if isinstance(value, list) and value and isinstance(value[0], dict):
            body = ",\n".join("    " + json.dumps(row, sort_keys=False) for row in value)
            lines.append(f"  {json.dumps(key)}: [\n{body}\n  ]{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")


def compile_only(args: argparse.Namespace) -> int:
    built, failed = compile_variants(args.arch, args.cache_dir)
    print(f"{len(built)} probes built for {args.arch}, {len(failed)} failed")
    for variant, kernel in built:
        print(
            f"  {variant.name:32s} regs={kernel.registers:3d} smem={kernel.shared_static_bytes:6d}"
            f" local={kernel.local_bytes:5d}"
        )
    for fail in failed:
        print(f"  FAILED {fail['name']}: {fail['error']}")
    return 1 if failed else 0


def check_probe(
    driver: Driver,
    gpu: GpuSpec,
    variant: Variant,
    compiled: CompiledKernel,
    info: dict[str, Any],
    rows: list[dict[str, Any] | None],
    available: list[dict[str, Any]],
) -> None:
    """Load one probe, ask the driver about every configuration of it, append the rows."""
    module, func = driver.load(compiled.cubin, KERNEL_NAME)
    try:
        loaded = Loaded(variant, compiled, module, func)
        loaded.registers = driver.func_attribute(func, FUNC_NUM_REGS)
        loaded.shared_static_bytes = driver.func_attribute(func, FUNC_SHARED_SIZE_BYTES)
        loaded.local_bytes = driver.func_attribute(func, FUNC_LOCAL_SIZE_BYTES)
        loaded.max_threads_per_block = driver.func_attribute(func, FUNC_MAX_THREADS_PER_BLOCK)
        info.update(
            registers=loaded.registers,
            shared_static_bytes=loaded.shared_static_bytes,
            local_bytes=loaded.local_bytes,
            max_threads_per_block=loaded.max_threads_per_block,
        )
        # Past a __launch_bounds__ maximum a launch is invalid whatever the resources, and
        # Kato's calculator is not told the bound: skip those. Without bounds every size is
        # asked, also those too big for the registers (the driver must answer 0).
        bound = variant.max_threads or gpu.max_threads_per_block
        blocks = [b for b in BLOCK_SIZES if b <= bound]
        if variant.shared_sweep and variant.nacc == 8 and variant.static_bytes in (1000, 4096):
            available.extend(available_dynamic_rows(driver, loaded, gpu))
        for block in blocks:
            for dynamic in dynamic_sizes(loaded, gpu, block):
                rows.append(query(driver, loaded, gpu, block, dynamic, None))
        # Carveout preferences last: the attribute stays set on the function.
        for percent in CARVEOUTS if variant.carveouts else ():
            driver.set_func_attribute(func, FUNC_PREFERRED_SHARED_MEMORY_CARVEOUT, percent)
            for block in CARVEOUT_BLOCK_SIZES:
                for dynamic in CARVEOUT_DYNAMIC:
                    rows.append(query(driver, loaded, gpu, block, dynamic, percent))
    finally:
        driver.unload(module)


def run(args: argparse.Namespace) -> int:
    driver = Driver(args.device)
    try:
        device = device_description(driver)
        cc = device["compute_capability"]
        gpu = find_gpu(device["model"])
        if gpu is not None:
            catalog = catalog_check(gpu, device)
        else:  # not in the catalog: check the calculator with the architecture's limits
            print(f"note: {device['name']} is not in the catalog; using cc {cc[0]}.{cc[1]} limits")
            sm_count = device["attributes"]["sm_count"]
            gpu = spec_for_compute_capability(device["model"], tuple(cc), sm_count)
            catalog = []
        built, failed = compile_variants(f"sm_{cc[0]}{cc[1]}", args.cache_dir)

        rows: list[dict[str, Any] | None] = []
        available: list[dict[str, Any]] = []
        probes: list[dict[str, Any]] = []
        for variant, compiled in built:
            info: dict[str, Any] = {"name": variant.name, "options": list(variant.options())}
            info["launch_bounds"] = (
                [variant.max_threads, variant.min_blocks] if variant.max_threads else None
            )
            info["ptxas_registers"] = compiled.registers
            probes.append(info)
            try:
                check_probe(driver, gpu, variant, compiled, info, rows, available)
            except DriverError as exc:  # a broken probe must not lose the others' rows
                info["error"] = str(exc)
                print(f"error: {variant.name}: {exc}")
    finally:
        driver.close()

    table_rows = [r for r in rows if r is not None]  # None: a configuration already asked
    disagree = [r for r in table_rows if agrees(r) is False]
    unusable = [r for r in table_rows if agrees(r) is None]
    bad_catalog = [c for c in catalog if not c["ok"]]
    summary = {
        "probes": len(probes),
        "probes_failed_to_compile": len(failed),
        "probes_with_driver_errors": sum("error" in p for p in probes),
        "rows": len(table_rows),
        "agree": len(table_rows) - len(disagree) - len(unusable),
        "disagree": len(disagree),
        "unusable": len(unusable),
        "rows_with_driver_error": sum("driver_error" in r for r in table_rows),
        "catalog_mismatches": [c["field"] for c in bad_catalog],
        "available_dynamic_kato_equals_driver": sum(
            a.get("driver_dynamic_bytes") == a["kato_dynamic_bytes"] for a in available
        ),
        "available_dynamic_rows": len(available),
    }
    table = {
        "schema": 1,
        "generated_by": "benchmarks/occupancy_check.py",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device,
        "summary": summary,
        "catalog_check": catalog,
        "compile_failures": failed,
        "probes": probes,
        "rows": table_rows,
        "available_dynamic": available,
    }
    out = args.out or default_out(device["model"])
    write_table(out, table)

    print(f"{device['name']} (cc {cc[0]}.{cc[1]}, driver {device['driver_version']}):")
    print(
        f"  {summary['rows']} configurations of {summary['probes']} probes: "
        f"{summary['agree']} agree, {summary['disagree']} disagree "
        f"({summary['rows_with_driver_error']} driver errors counted as 0 blocks)"
    )
    for row in disagree[:25]:
        print(
            f"  DISAGREE {row['name']}: {row['threads_per_block']} threads,"
            f" {row['registers']} regs,"
            f" static {row['shared_static_bytes']} + dynamic {row['dynamic_shared_bytes']},"
            f" carveout {row['carveout']}: driver {row['driver_blocks_per_sm']},"
            f" kato {row['kato_blocks_per_sm']}"
        )
    for row in unusable[:10]:
        print(f"  UNUSABLE {row['name']}: {row['setup_error']}")
    for check in bad_catalog:
        print(f"  CATALOG {check['field']}: catalog {check['catalog']}, device {check['device']}")
    if failed:
        print(f"  {len(failed)} probes failed to compile: {[f['name'] for f in failed]}")
    print(
        f"  cuOccupancyAvailableDynamicSMemPerBlock equals max_dynamic_shared_for in "
        f"{summary['available_dynamic_kato_equals_driver']}/{len(available)} cases (informational)"
    )
    print(f"  wrote {out}")
    broken = failed or unusable or summary["probes_with_driver_errors"]
    return 1 if disagree or bad_catalog or broken else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON table (default $OUT/occupancy_<model>.json)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    parser.add_argument("--cache-dir", type=Path, help="nvcc cache (default: kato.tuner.nvcc's)")
    parser.add_argument(
        "--compile-only", action="store_true", help="only build the probes and list their resources"
    )
    parser.add_argument("--arch", default="sm_90", help="target for --compile-only")
    args = parser.parse_args(argv)
    return compile_only(args) if args.compile_only else run(args)


if __name__ == "__main__":
    sys.exit(main())
