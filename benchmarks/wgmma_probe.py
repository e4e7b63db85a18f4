"""Probe of the Hopper wgmma + TMA GEMM (``kernels/matmul/matmul_wgmma.cu``) against cuBLAS.

Compiles a handful of variants for ``sm_90a`` (float16 and bfloat16, layouts nn / nt / tn), then
runs each (variant, dtype) in its own child process: a wrong descriptor or byte count makes the
kernel trap after its bounded mbarrier waits, which kills that process's CUDA context, not the
probe (the parent restarts a child for the cases left and marks the failed one). Every case is
verified against a float32 torch reference (no TF32) before it is timed; the timings are CUDA
events, the median of 20 launches after warm-up, with ``torch.matmul`` on the same inputs in
the same process. A variant that traps is re-run once at the smallest shape in a debug build
that records which mbarrier wait timed out.

    python3 benchmarks/wgmma_probe.py --out $OUT            # everything, about 2-4 minutes
    python3 benchmarks/wgmma_probe.py --compile-only        # nvcc + ptxas report, no GPU
    python3 benchmarks/wgmma_probe.py --variants m1_128x128 --shapes 256x256x256

Prints a table (flushed as it goes) and writes ``wgmma_probe.json`` into ``--out``.
Needs nvcc; running needs a Hopper GPU, PyTorch with CUDA and libcuda (no PyCUDA).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "matmul" / "matmul_wgmma.cu"
KERNEL = "kato_matmul_wgmma"
ARCH = "sm_90a"
LAYOUTS = {"nn": (0, 0), "nt": (0, 1), "tn": (1, 0)}  # (TRANS_A, TRANS_B)
DTYPES = ("float16", "bfloat16")
#: (M, N, K) per layout, the tile-aligned 256^3 first (a crash there skips the rest of the
#: layout); 64 x 72 x 8 is smaller than every tile in all three dimensions, 1000^3 has partial
#: tiles everywhere; 8192 x 50257 x 768 is the logits matmul x @ W^T of a GPT-2 step.
SHAPES = {
    "nn": [(256, 256, 256), (64, 72, 8), (1000, 1000, 1000), (8192, 768, 3072), (4096, 4096, 4096),
           (8192, 8192, 8192)],
    "nt": [(256, 256, 256), (64, 72, 8), (1000, 1000, 1000), (8192, 768, 3072), (4096, 4096, 4096),
           (8192, 8192, 8192), (8192, 50257, 768)],
    "tn": [(256, 256, 256), (64, 72, 8), (1000, 1000, 1000), (768, 3072, 8192), (4096, 4096, 4096),
           (8192, 8192, 8192)],
}  # fmt: skip
REPEATS = 20
WARMUP = 3
#: A child runs one (variant, dtype), ~40 cases; a debug child one case.
CHILD_TIMEOUT_S = 150
DEBUG_TIMEOUT_S = 30
MAX_DEBUG_RUNS = 3
_START = time.perf_counter()


@dataclass(frozen=True)
class Variant:
    """One compile-time configuration of the template (its -D values besides dtype/layout)."""

    name: str
    defines: dict[str, int]
    #: Grids to time: "tiles" (one CTA per output tile) and/or "persistent" (one per SM).
    grids: tuple[str, ...] = ("tiles",)
    #: Only these layouts / shapes (None = all); diagnostic variants run small shapes only.
    layouts: tuple[str, ...] | None = None
    max_elements: int | None = None
    note: str = ""
    #: Run only when a regular variant failed (or with --diagnostics): these invert one guess
    #: about the descriptors and should fail where the regular variants pass.
    diagnostic: bool = False

    @property
    def threads(self) -> int:
        return 128 * (self.defines["CONSUMERS"] + 1)

    @property
    def cluster(self) -> int:
        return self.defines["CLUSTER_M"]

    def grid(self, m: int, n: int, mode: str, sms: int) -> int:
        """CTAs of a launch: one per output tile, or (persistent) one per SM, in whole
        clusters; the kernel loops over cluster tiles of CLUSTER_M * BM x BN."""
        bm, bn, cl = self.defines["BM"], self.defines["BN"], self.cluster
        cluster_tiles = -(-m // (bm * cl)) * -(-n // bn)
        clusters = cluster_tiles if mode == "tiles" else min(cluster_tiles, sms // cl)
        return clusters * cl

    @property
    def smem_bytes(self) -> int:
        d = self.defines
        return d["STAGES"] * (d["BM"] + d["BN"]) * 64 * 2 + 1024


def _v(name, bm, bn, stages, consumers, inflight, regs, grids, **extra) -> Variant:
    producer, consumer = regs
    defines = {
        "BM": bm, "BN": bn, "BK": 64, "STAGES": stages, "CONSUMERS": consumers,
        "INFLIGHT": inflight, "PRODUCER_REGS": producer, "CONSUMER_REGS": consumer,
        "GROUP_M": 8, "CLUSTER_M": 1,
    }  # fmt: skip
    diag = {k: extra.pop(k) for k in list(extra) if k.isupper()}
    defines.update(diag)
    return Variant(name, defines, grids, **extra)


#: Milestone 1 (one consumer warpgroup, no setmaxnreg, wait for each stage's wgmmas), then
#: milestone 2 (two consumers, setmaxnreg 40 / 232, one stage in flight, persistent grid), 2-CTA
#: clusters with B multicast, and diagnostic twins that invert one guess about the descriptors.
VARIANTS = (
    _v("m1_128x64", 128, 64, 4, 1, 0, (0, 0), ("tiles",),
       note="1 consumer; nn's B is one 64-wide MN chunk: its leading offset is unused"),
    _v("m1_128x128", 128, 128, 4, 1, 0, (0, 0), ("tiles",), note="milestone 1"),
    _v("m2_128x128_s6", 128, 128, 6, 2, 1, (40, 232), ("tiles", "persistent")),
    _v("m2_128x256_s3", 128, 256, 3, 2, 1, (40, 232), ("tiles", "persistent")),
    _v("m2_128x256_s4", 128, 256, 4, 2, 1, (40, 232), ("tiles", "persistent")),
    _v("m2_256x128_s4", 256, 128, 4, 2, 1, (40, 232), ("tiles", "persistent")),
    _v("m2c2_128x256_s4", 128, 256, 4, 2, 1, (40, 232), ("tiles", "persistent"), CLUSTER_M=2,
       note="2-CTA clusters along M, B multicast"),
    _v("m2c2_256x128_s4", 256, 128, 4, 2, 1, (40, 232), ("tiles", "persistent"), CLUSTER_M=2,
       note="2-CTA clusters along M, B multicast"),
    _v("diag_swap_lbo_sbo", 128, 256, 4, 2, 1, (40, 232), ("tiles",), MN_SWAP_LBO_SBO=1,
       layouts=("nn", "tn"), max_elements=1000**3, diagnostic=True,
       note="MN-major LBO/SBO swapped: should FAIL where m2_128x256_s4 passes"),
    _v("diag_flip_transpose", 128, 128, 4, 1, 0, (0, 0), ("tiles",), FLIP_TRANSPOSE=1,
       max_elements=1000**3, diagnostic=True,
       note="transpose immediates inverted: should FAIL where m1_128x128 passes"),
)  # fmt: skip


def compile_options(variant: Variant, dtype: str, layout: str, debug: bool = False) -> tuple:
    """nvcc -D options of one build."""
    trans_a, trans_b = LAYOUTS[layout]
    defines = dict(variant.defines, IS_BF16=int(dtype == "bfloat16"), TRANS_A=trans_a)
    defines.update(TRANS_B=trans_b, KATO_WGMMA_DEBUG=int(debug))
    return tuple(f"-D{k}={v}" for k, v in sorted(defines.items()))


def variant_layouts(variant: Variant) -> tuple[str, ...]:
    return variant.layouts or tuple(LAYOUTS)


def compile_all(
    variants, debug: bool = False, cache_dir: Path | None = None, dtypes=DTYPES
) -> dict:
    """Compile every (variant, dtype, layout); {(name, dtype, layout): CompiledKernel or
    CompileError}. Compile errors are returned, never raised."""
    from kato.tuner.nvcc import CompileJob, compile_many

    source = SOURCE.read_text()
    keys, jobs = [], []
    for variant in variants:
        for dtype in dtypes:
            for layout in variant_layouts(variant):
                keys.append((variant.name, dtype, layout))
                options = compile_options(variant, dtype, layout, debug)
                jobs.append(CompileJob(source, KERNEL, ARCH, options))
    results = compile_many(jobs, cache_dir=cache_dir)
    return dict(zip(keys, results, strict=True))


def ptxas_summary(compiled) -> dict:
    """Registers, spills and the performance warnings of one compile (or its error)."""
    from kato.tuner.nvcc import CompileError

    if isinstance(compiled, CompileError):
        return {"error": str(compiled), "log": compiled.log[-2000:]}
    warnings = [line.strip() for line in compiled.log.splitlines() if "Performance" in line]
    return {
        "registers": compiled.registers,
        "spill_bytes": compiled.spill_bytes,
        "local_bytes": compiled.local_bytes,
        "static_smem": compiled.shared_static_bytes,
        "warnings": warnings,
    }


_PTXAS_KEYS = ("registers", "spill_bytes", "warnings")


def log(message: str) -> None:
    print(message, flush=True)


# --- child: runs on the GPU ------------------------------------------------------------------

_TMAP_DTYPE = {"float16": 6, "bfloat16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3


class TensorMap:
    """A CUtensorMap (128 bytes, 64-byte aligned) encoded by cuTensorMapEncodeTiled for a
    row-major (rows, cols) matrix of 16-bit elements, box {64 columns, box_rows}, 128-byte
    swizzle, out-of-bounds elements read as zero."""

    def __init__(self, lib, dtype: str, ptr: int, rows: int, cols: int, box_rows: int):
        self._raw = (ctypes.c_ubyte * 192)()
        address = (ctypes.addressof(self._raw) + 63) & ~63
        self.value = (ctypes.c_uint64 * 16).from_address(address)
        dims = (ctypes.c_uint64 * 2)(cols, rows)
        strides = (ctypes.c_uint64 * 1)(cols * 2)
        box = (ctypes.c_uint32 * 2)(64, box_rows)
        elem = (ctypes.c_uint32 * 2)(1, 1)
        result = lib.cuTensorMapEncodeTiled(
            ctypes.c_void_p(address), _TMAP_DTYPE[dtype], 2, ctypes.c_void_p(ptr), dims,
            strides, box, elem, 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0,
        )  # fmt: skip
        if result != 0:
            raise RuntimeError(
                f"cuTensorMapEncodeTiled failed ({result}) for {rows}x{cols} box {box_rows}"
            )


def _tensor_maps(lib, variant: Variant, dtype, layout, a, b, m, n, k):
    bm, bn = variant.defines["BM"], variant.defines["BN"]
    trans_a, trans_b = LAYOUTS[layout]
    # K-major operands load a {64 k, tile rows} box; MN-major ones {64 m/n, 64 k} per chunk.
    map_a = (
        TensorMap(lib, dtype, a.data_ptr(), k, m, 64)
        if trans_a
        else TensorMap(lib, dtype, a.data_ptr(), m, k, bm)
    )
    # With clusters each CTA loads (and multicasts) 1 / CLUSTER_M of B's rows.
    map_b = (
        TensorMap(lib, dtype, b.data_ptr(), n, k, bn // variant.cluster)
        if trans_b
        else TensorMap(lib, dtype, b.data_ptr(), k, n, 64)
    )
    return map_a, map_b


def _inputs(torch, dtype, layout, m, n, k, seed):
    """A, B in their stored layouts, scaled so that C's entries are about N(0, 1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dtype)
    trans_a, trans_b = LAYOUTS[layout]
    a_shape = (k, m) if trans_a else (m, k)
    b_shape = (n, k) if trans_b else (k, n)
    a = torch.randn(a_shape, device="cuda", generator=gen).to(tdt)
    b = (torch.randn(b_shape, device="cuda", generator=gen) / math.sqrt(k)).to(tdt)
    return a, b


def _torch_op(layout, a, b):
    trans_a, trans_b = LAYOUTS[layout]
    return (a.t() if trans_a else a) @ (b.t() if trans_b else b)


def _check(torch, c, ref, dtype) -> dict:
    """Element-wise |c - ref| <= tol * (1 + |ref|); C is about N(0, 1), float32 accumulation
    on both sides, so what is left is C's rounding to the input type (2^-9 relative for
    bfloat16): tol 1e-2 (float16) / 2e-2 (bfloat16) leaves a margin, a wrong layout is O(1)."""
    tol = 2e-2 if dtype == "bfloat16" else 1e-2
    cf = c.float()
    diff = (cf - ref).abs()
    bad = diff > tol * (1 + ref.abs())
    bad_count = int(bad.sum())
    out = {
        "ok": bad_count == 0 and not bool(torch.isnan(cf).any()),
        "max_abs_err": float(diff.max()),
        "bad_fraction": bad_count / bad.numel(),
        "nan": int(torch.isnan(cf).sum()),
    }
    if not out["ok"]:
        # Where the errors sit says which part is wrong: rows / columns mod 64 (a descriptor
        # or fragment-layout bug repeats with the 64-wide swizzle chunks or m64 slices).
        rows = bad.any(dim=1).nonzero().flatten()[:8].tolist()
        cols = bad.any(dim=0).nonzero().flatten()[:8].tolist()
        first = bad.nonzero()[:5].tolist()
        out["first_bad"] = [(r, q, float(cf[r, q]), float(ref[r, q])) for r, q in first]
        out["bad_rows_head"], out["bad_cols_head"] = rows, cols
        out["bad_row_fraction"] = float(bad.any(dim=1).float().mean())
        out["bad_col_fraction"] = float(bad.any(dim=0).float().mean())
        out["all_zero"] = bool((cf == 0).all())
        flat_c, flat_r = cf.flatten()[: 1 << 22], ref.flatten()[: 1 << 22]
        out["corr"] = float(torch.corrcoef(torch.stack([flat_c, flat_r]))[0, 1])
        # The right values in the wrong places (an epilogue / fragment-order bug) keep each
        # 64 x 64 block's sorted values; a descriptor bug changes the values themselves.
        block_c, block_r = cf[:64, :64].flatten().sort()[0], ref[:64, :64].flatten().sort()[0]
        out["block0_same_values"] = bool(
            ((block_c - block_r).abs() <= tol * (1 + block_r.abs())).all()
        )
    return out


def _time_ms(torch, fn) -> float:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_child(args) -> int:
    """Run one (variant, dtype): every case on stdin's list, one JSON line per case."""
    import torch

    from kato_torch import _driver

    variant = next(v for v in VARIANTS if v.name == args.child_variant)
    cases = json.loads(args.child_cases)
    cubins = json.loads(args.child_cubins)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.init()
    torch.empty(1, device="cuda")
    lib = _driver._driver()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    funcs = {}
    for layout, path in cubins.items():
        module = _driver.load_module(Path(path).read_bytes())
        funcs[layout] = (module, _driver.get_function(module, KERNEL, variant.smem_bytes))
    stream = torch.cuda.current_stream().cuda_stream
    for case in cases:
        layout, (m, n, k), dtype = case["layout"], case["shape"], case["dtype"]
        row = dict(case)
        a, b = _inputs(torch, dtype, layout, m, n, k, seed=m + n + k)
        c = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
        map_a, map_b = _tensor_maps(lib, variant, dtype, layout, a, b, m, n, k)
        grid = variant.grid(m, n, case["grid"], sms)
        args_ = [map_a.value, map_b.value, ctypes.c_void_p(c.data_ptr())]
        args_ += [ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k)]
        module, func = funcs[layout]

        def launch(func=func, grid=grid, args_=args_):
            _driver.launch(func, (grid, 1, 1), (variant.threads, 1, 1), variant.smem_bytes,
                           stream, args_)  # fmt: skip

        if args.debug:
            flag = ctypes.c_uint64()
            size = ctypes.c_size_t()
            _driver._check(
                lib.cuModuleGetGlobal_v2(
                    ctypes.byref(flag), ctypes.byref(size), module, b"kato_wgmma_timeout"
                ),
                "cuModuleGetGlobal",
            )
            launch()
            torch.cuda.synchronize()
            words = (ctypes.c_uint32 * 4)()
            _driver._check(lib.cuMemcpyDtoH_v2(words, flag, ctypes.c_size_t(16)), "cuMemcpyDtoH")
            what = ("none", "full", "empty", "stream-k counter")[min(words[0], 3)]
            row["debug_timeout"] = {"barrier": what, "stage": words[1], "parity": words[2],
                                    "block": words[3]}  # fmt: skip
            print(json.dumps(row), flush=True)
            continue
        launch()
        torch.cuda.synchronize()
        ref = _torch_op(layout, a.float(), b.float())
        row.update(_check(torch, c, ref, dtype))
        del ref
        if row["ok"]:
            ms = _time_ms(torch, launch)
            torch_ms = _time_ms(torch, lambda a=a, b=b, layout=layout: _torch_op(layout, a, b))
            flop = 2.0 * m * n * k
            row.update(ms=ms, tflops=flop / ms / 1e9, torch_ms=torch_ms)
            row.update(torch_tflops=flop / torch_ms / 1e9, vs_torch=torch_ms / ms)
        print(json.dumps(row), flush=True)
    return 0


# --- parent ---------------------------------------------------------------------------------


@dataclass
class Job:
    variant: Variant
    dtype: str
    cases: list[dict]
    cubins: dict[str, str]
    results: list[dict] = field(default_factory=list)


def _spawn(job: Job, cases: list[dict], debug: bool = False) -> tuple[list[dict], str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-variant", job.variant.name]
    cmd += ["--child-cases", json.dumps(cases), "--child-cubins", json.dumps(job.cubins)]
    if debug:
        cmd.append("--debug")
    rows: list[dict] = []
    timeout = DEBUG_TIMEOUT_S if debug else CHILD_TIMEOUT_S
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = f"child timed out after {timeout} s"
    for line in out.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows, err[-1500:]


def run_job(job: Job) -> None:
    """Run a job's cases in children; a child that dies marks its current case failed and a
    new child takes the rest. A child that dies on a layout's first case ends that layout (its
    larger shapes would trap the same way): its other cases are marked skipped."""
    left = list(job.cases)
    while left:
        rows, err = _spawn(job, left)
        for row in rows:
            job.results.append(row)
            print_row(job.variant, row)
        left = left[len(rows) :]
        if not left:
            break
        failed = dict(left[0], ok=False, error=err.strip().splitlines()[-3:] or ["died"])
        job.results.append(failed)
        print_row(job.variant, failed)
        layout, left = left[0]["layout"], left[1:]
        if not rows:
            for case in [c for c in left if c["layout"] == layout]:
                job.results.append(dict(case, ok=False, skipped="an earlier case crashed"))
            left = [c for c in left if c["layout"] != layout]


_DIAGNOSTICS = ("max_abs_err", "bad_fraction", "bad_row_fraction", "bad_col_fraction", "all_zero")
_DIAGNOSTICS += ("corr", "nan", "block0_same_values")


def print_row(variant: Variant, row: dict) -> None:
    shape = "x".join(map(str, row["shape"]))
    head = f"{variant.name:18s} {row['dtype']:8s} {row['layout']} {row['grid']:10s} {shape:17s}"
    if "skipped" in row:
        log(f"{head} SKIPPED ({row['skipped']})")
    elif "debug_timeout" in row:
        log(f"{head} DEBUG timeout: {row['debug_timeout']}")
    elif "error" in row:
        log(f"{head} CRASH {' | '.join(row['error'])}")
    elif not row["ok"]:
        detail = {k: row.get(k) for k in _DIAGNOSTICS}
        log(f"{head} WRONG {detail} first={row.get('first_bad')}")
    else:
        log(
            f"{head} ok err={row['max_abs_err']:.2e} {row['ms']:8.3f} ms {row['tflops']:6.1f} "
            f"TFLOP/s  torch {row['torch_tflops']:6.1f}  = {100 * row['vs_torch']:5.1f}%"
        )


def parse_shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(x) for x in text.lower().split("x"))
    return m, n, k


def build_jobs(variants, compiled, cubin_dir: Path, shapes_override, dtypes) -> list[Job]:
    from kato.tuner.nvcc import CompileError

    jobs = []
    for variant in variants:
        for dtype in dtypes:
            cubins, cases = {}, []
            for layout in variant_layouts(variant):
                result = compiled[(variant.name, dtype, layout)]
                if isinstance(result, CompileError):
                    continue
                path = cubin_dir / f"{variant.name}_{dtype}_{layout}.cubin"
                path.write_bytes(result.cubin)
                cubins[layout] = str(path)
                for shape in shapes_override or SHAPES[layout]:
                    m, n, k = shape
                    if variant.max_elements and m * n * k > variant.max_elements:
                        continue
                    trans_a, trans_b = LAYOUTS[layout]
                    pitches = (m if trans_a else k, k if trans_b else n)
                    if any(p % 8 for p in pitches):
                        log(f"skip {variant.name} {layout} {shape}: a pitch is not 8-aligned")
                        continue
                    for grid in variant.grids:
                        cases.append({"layout": layout, "shape": list(shape), "dtype": dtype,
                                      "grid": grid})  # fmt: skip
            if cases:
                jobs.append(Job(variant, dtype, cases, cubins))
    return jobs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--variants", nargs="*", help="names (default: every regular one)")
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    parser.add_argument("--shapes", nargs="*", type=parse_shape, help="MxNxK (every layout)")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument(
        "--budget-s", type=float, default=500.0,
        help="start no new child after this many seconds (the device tool allows 600 a command)",
    )  # fmt: skip
    parser.add_argument(
        "--diagnostics", action="store_true", help="run the diagnostic variants even if all pass"
    )
    parser.add_argument("--child-variant", help=argparse.SUPPRESS)
    parser.add_argument("--child-cases", help=argparse.SUPPRESS)
    parser.add_argument("--child-cubins", help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_variant:
        return run_child(args)

    t0 = _START
    args.out.mkdir(parents=True, exist_ok=True)
    out_path = args.out / "wgmma_probe.json"
    report = {"arch": ARCH, "compile": {}, "results": [], "debug": []}
    chosen = [v for v in VARIANTS if (v.name in args.variants if args.variants else True)]
    regular = [v for v in chosen if args.variants or not v.diagnostic]
    compiled = _compile(regular, report, args.dtypes)
    if args.compile_only:
        compiled.update(_compile([v for v in chosen if v not in regular], report, args.dtypes))
        out_path.write_text(json.dumps(report, indent=1))
        return 0 if all("error" not in s for s in report["compile"].values()) else 1

    log(f"{'variant':18s} {'dtype':8s} lay {'grid':10s} {'M x N x K':17s} result")
    _run(regular, compiled, args, report, out_path)
    failed = any(not r.get("ok") for r in report["results"])
    extra = [v for v in VARIANTS if v.diagnostic and v not in regular]
    if extra and (failed or args.diagnostics):
        log("diagnostic variants (each inverts one guess; expected to FAIL where others pass):")
        _run(extra, _compile(extra, report, args.dtypes), args, report, out_path)
    _debug_crashes(regular + extra, args, report)
    report["best"] = best_per_case(report["results"])
    log("best verified variant per case (TFLOP/s, % of torch.matmul):")
    for row in report["best"]:
        log(f"  {row['dtype']:8s} {row['layout']} {'x'.join(map(str, row['shape'])):17s} "
            f"{row['tflops']:6.1f} vs {row['torch_tflops']:6.1f} = {100 * row['vs_torch']:5.1f}%  "
            f"{row['variant']} ({row['grid']})")  # fmt: skip
    out_path.write_text(json.dumps(report, indent=1))
    passed = sum(1 for r in report["results"] if r.get("ok"))
    log(f"{passed} of {len(report['results'])} cases passed; wrote {out_path} "
        f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    return 0


def best_per_case(results: list[dict]) -> list[dict]:
    """The fastest verified regular (non-diagnostic) row of every (dtype, layout, shape)."""
    diagnostic = {v.name for v in VARIANTS if v.diagnostic}
    best: dict[tuple, dict] = {}
    for row in results:
        if not row.get("ok") or "tflops" not in row or row["variant"] in diagnostic:
            continue
        key = (row["dtype"], row["layout"], tuple(row["shape"]))
        if key not in best or row["tflops"] > best[key]["tflops"]:
            best[key] = row
    return [best[key] for key in sorted(best)]


def _compile(variants, report, dtypes, debug: bool = False) -> dict:
    t0 = time.perf_counter()
    log(f"compiling {len(variants)} variants x dtypes x layouts for {ARCH} (debug={debug})")
    compiled = compile_all(variants, debug=debug, dtypes=dtypes)
    for (name, dtype, layout), result in compiled.items():
        summary = ptxas_summary(result)
        if not debug:
            report["compile"][f"{name}/{dtype}/{layout}"] = summary
        brief = summary if "error" in summary else {k: summary[k] for k in _PTXAS_KEYS}
        log(f"  {name:18s} {dtype:8s} {layout}: {brief}")
    log(f"compiled in {time.perf_counter() - t0:.1f} s")
    return compiled


def _run(variants, compiled, args, report, out_path: Path) -> None:
    cubin_dir = args.out / "cubins"
    cubin_dir.mkdir(exist_ok=True)
    for job in build_jobs(variants, compiled, cubin_dir, args.shapes, args.dtypes):
        if time.perf_counter() - _START > args.budget_s:
            log(f"{job.variant.name} {job.dtype}: not run, past --budget-s {args.budget_s:g}")
            report.setdefault("not_run", []).append(f"{job.variant.name}/{job.dtype}")
            continue
        run_job(job)
        report["results"].extend(dict(r, variant=job.variant.name) for r in job.results)
        out_path.write_text(json.dumps(report, indent=1))


def _debug_crashes(variants, args, report) -> None:
    """A (variant, dtype) whose launches died: once more at its first crashed case, in the debug
    build that records the mbarrier wait that timed out instead of trapping."""
    crashed = {(r["variant"], r["dtype"]) for r in report["results"] if "error" in r}
    # A few are enough to tell which barrier hangs; each costs a compile and up to 30 s.
    crashed = set(sorted(crashed)[:MAX_DEBUG_RUNS])
    if time.perf_counter() - _START > args.budget_s:
        crashed = set()
    targets = [v for v in variants if any(v.name == name for name, _ in crashed)]
    if not targets:
        return
    debug_dir = args.out / "cubins_debug"
    debug_dir.mkdir(exist_ok=True)
    compiled = _compile(targets, report, args.dtypes, debug=True)
    for job in build_jobs(targets, compiled, debug_dir, args.shapes, args.dtypes):
        if (job.variant.name, job.dtype) not in crashed:
            continue
        first = [c for c in job.cases if "error" in _match(report, job, c)][:1]
        if first:
            rows, err = _spawn(job, first, debug=True)
            for row in rows:
                print_row(job.variant, row)
            if not rows:
                log(f"{job.variant.name} {job.dtype} debug run died too: {err[-300:]}")
            report["debug"].append({"variant": job.variant.name, "rows": rows, "err": err})


def _match(report, job, case) -> dict:
    for row in report["results"]:
        if row["variant"] == job.variant.name and all(row[k] == case[k] for k in case):
            return row
    return {}


if __name__ == "__main__":
    sys.exit(main())
