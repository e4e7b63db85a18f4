"""Run a CUDA template's kernels on the CPU: host C++ (g++, C++20) with a small emulation of the
CUDA features the transpose and sort templates use.

One cooperative thread (a ``ucontext`` fiber) per CUDA thread, blocks one after another, the
fibers of a block taking turns on one OS thread: each runs until it waits at a barrier
(``__syncthreads``, and the warp's for shuffles: every lane of a warp must call them, as with a
full mask on the GPU) or ends; odd blocks take their turns in reverse order, so that a missing
barrier shows whichever thread writes first. Barriers that can never complete (threads waiting
at different ones) fail the case (exit 84) instead of hanging. ``static`` for ``__shared__``
(blocks run one at a time) and, for dynamic shared memory, exactly the step's
``Launch.shared_bytes``, filled with garbage before every block and ending at an inaccessible
page: a kernel that indexes past what its launch gives it fails the case (exit 86, or 87 for a
write into the bytes up to the next multiple of 16). Every step of ``spec.steps()`` is launched
with its real grid, block and shared bytes, so the kernels' indexing, guards, barriers and
grid-stride loops run exactly as written; only the memory hierarchy differs. (One OS thread per
CUDA thread, as before, spent most of the emulation tests' time creating threads and switching
between them at every barrier.)

CI has no GPU: this is how the kernels' logic is checked there.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from kato.kernels.spec import Config, OperatorSpec, Problem, template_source

#: The cooperative threads of a block, for :data:`HEADER` and the compile tests' own emulations:
#: ``EmuBarrier`` (``arrive_and_wait``) and ``emu_run_block(kernel, threads, block, turn)``,
#: which runs ``kernel`` as ``threads`` fibers until every one returns, calling ``turn(t)``
#: before each turn of fiber t (to set threadIdx and the warp), in reverse order for odd
#: ``block`` ids; exit 84 when the waiting fibers can never go on. Needs <cstdio>, <cstdlib>,
#: <vector>, <sys/mman.h> and <ucontext.h>.
FIBERS = r"""
inline void emu_yield();
// A barrier of `count` fibers: the last to arrive releases the others and runs on.
struct EmuBarrier {
  unsigned count, arrived = 0;
  unsigned long long phase = 0;
  void arrive_and_wait();
};
// Arrivals and ends of fibers: a round of turns that adds none is a deadlock.
unsigned long long emu_progress;
inline void EmuBarrier::arrive_and_wait() {
  const unsigned long long mine = phase;
  ++emu_progress;
  if (++arrived == count) {
    arrived = 0;
    ++phase;
    return;
  }
  while (phase == mine) emu_yield();
}
// The fibers of a block: their stacks (kEmuStack bytes each, mapped once, touched as used),
// contexts, and whether each has returned.
constexpr size_t kEmuStack = 512 * 1024;
std::vector<unsigned char*> emu_stacks;
std::vector<ucontext_t> emu_contexts;
std::vector<char> emu_done;
ucontext_t emu_scheduler;
unsigned emu_current;
void* emu_kernel;
inline void emu_yield() { swapcontext(&emu_contexts[emu_current], &emu_scheduler); }
template <class F> void emu_fiber() {
  (*static_cast<F*>(emu_kernel))();
  emu_done[emu_current] = 1;
  ++emu_progress;
}  // returns to emu_scheduler (uc_link)
template <class F, class T>
void emu_run_block(F& kernel, unsigned threads, unsigned block, const T& turn) {
  while (emu_stacks.size() < threads) {
    void* stack = mmap(nullptr, kEmuStack, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stack == MAP_FAILED) std::abort();
    emu_stacks.push_back(static_cast<unsigned char*>(stack));
  }
  emu_contexts.resize(threads);
  emu_done.assign(threads, 0);
  emu_kernel = &kernel;
  for (unsigned t = 0; t < threads; ++t) {
    getcontext(&emu_contexts[t]);
    emu_contexts[t].uc_stack.ss_sp = emu_stacks[t];
    emu_contexts[t].uc_stack.ss_size = kEmuStack;
    emu_contexts[t].uc_link = &emu_scheduler;
    makecontext(&emu_contexts[t], emu_fiber<F>, 0);
  }
  for (unsigned left = threads; left > 0;) {
    const unsigned long long before = emu_progress;
    for (unsigned k = 0; k < threads; ++k) {
      const unsigned t = block % 2 ? threads - 1 - k : k;
      if (emu_done[t]) continue;
      emu_current = t;
      turn(t);
      swapcontext(&emu_scheduler, &emu_contexts[t]);
      if (emu_done[t]) --left;
    }
    if (left > 0 && emu_progress == before) {
      std::fprintf(stderr, "block %u: %u threads wait at barriers that cannot complete\n",
                   block, left);
      std::_Exit(84);
    }
  }
}
"""

HEADER = (
    r"""
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector_types.h>
#include <vector_functions.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// The running fiber's; the scheduler in launch() sets them before every turn.
uint3 threadIdx, blockIdx, blockDim, gridDim;
"""
    + FIBERS
    + r"""
struct Warp { unsigned long long lanes[32]; EmuBarrier sync{32}; };
Warp* this_warp;
EmuBarrier* this_block;
inline void __syncthreads() { this_block->arrive_and_wait(); }
inline unsigned lane_id() {
  return (threadIdx.x + threadIdx.y * blockDim.x) & 31;
}
template <class V> inline V __shfl_xor_sync(unsigned, V v, int offset) {
  static_assert(sizeof(V) <= 8);
  const unsigned lane = lane_id();
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(V));
  this_warp->lanes[lane] = bits;
  this_warp->sync.arrive_and_wait();
  bits = this_warp->lanes[lane ^ offset];
  this_warp->sync.arrive_and_wait();
  V other;
  std::memcpy(&other, &bits, sizeof(V));
  return other;
}
// The array arguments of a case run with Case.bounds (empty otherwise): a global access
// outside all of them exits 89, although the buffers' padding would not fault.
struct EmuRange { uintptr_t begin, end; };
std::vector<EmuRange> emu_ranges;
// Global loads and stores through these fault on a misaligned address, as on the GPU (a
// 16-byte vector must be 16-byte aligned): exit 88.
template <class V> inline const V* emu_aligned(const V* p) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  if (at % alignof(V) != 0) {
    std::fprintf(stderr, "misaligned %zu-byte access at %p\n", sizeof(V), (const void*)p);
    std::_Exit(88);
  }
  bool inside = emu_ranges.empty();
  for (const EmuRange& r : emu_ranges) inside |= at >= r.begin && at + sizeof(V) <= r.end;
  if (!inside) {
    std::fprintf(stderr, "%zu-byte access at %p outside every array\n", sizeof(V),
                 (const void*)p);
    std::_Exit(89);
  }
  return p;
}
template <class V> inline V __ldg(const V* p) { return *emu_aligned(p); }
template <class V> inline V __ldcs(const V* p) { return *emu_aligned(p); }
template <class V> inline void __stcs(V* p, V v) { *const_cast<V*>(emu_aligned(p)) = v; }
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
  const unsigned long long bytes = a | (static_cast<unsigned long long>(b) << 32);
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= ((bytes >> (8 * ((s >> (4 * n)) & 7))) & 0xffu) << (8 * n);
  return r;
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
// Dynamic shared memory: exactly the launch's bytes, ending where an inaccessible page
// begins, so that any access past them faults (reads too); the up to 15 bytes between the
// launch's size and the next multiple of 16 (the base stays 16-byte aligned) are a canary,
// checked after every block.
constexpr size_t kEmuSmemMax = 232448;
unsigned char* emu_smem;        // this block's dynamic shared memory
unsigned char* emu_smem_guard;  // the first byte of the inaccessible page
long emu_page;
char emu_fault_message[256];
inline void emu_smem_fault(int, siginfo_t* info, void*) {
  const unsigned char* at = static_cast<const unsigned char*>(info->si_addr);
  const bool guard = at >= emu_smem_guard && at < emu_smem_guard + emu_page;
  const char* text = guard ? emu_fault_message : "SIGSEGV outside dynamic shared memory\n";
  if (write(2, text, std::strlen(text)) < 0) _exit(86);
  _exit(guard ? 86 : 139);
}
inline void emu_smem_setup() {
  if (emu_smem_guard) return;
  emu_page = sysconf(_SC_PAGESIZE);
  const size_t room = (kEmuSmemMax + 16 + emu_page - 1) / emu_page * emu_page;
  void* base = mmap(nullptr, room + emu_page, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) std::abort();
  emu_smem_guard = static_cast<unsigned char*>(base) + room;
  if (mprotect(emu_smem_guard, emu_page, PROT_NONE) != 0) std::abort();
  struct sigaction action {};
  action.sa_sigaction = emu_smem_fault;
  action.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &action, nullptr);
}
constexpr unsigned char kEmuCanary = 0xa5;
// A buffer converts to whatever pointer type the kernel's parameter has.
struct AnyPtr {
  void* p;
  template <class T> operator T*() const { return static_cast<T*>(p); }
};
// Runs grid blocks of bx x by threads, one block after another, each with `shared` bytes of
// dynamic shared memory (Launch.shared_bytes); exits 86 or 87 when a block touches more.
template <class F>
void launch(F kernel, unsigned grid, unsigned bx, unsigned by, size_t shared) {
  emu_smem_setup();
  if (shared > kEmuSmemMax) {
    std::fprintf(stderr, "launch: %zu bytes of dynamic shared memory > %zu\n", shared,
                 kEmuSmemMax);
    std::exit(85);
  }
  const size_t room = (shared + 15) / 16 * 16;
  emu_smem = emu_smem_guard - room;
  const unsigned block = bx * by;
  for (unsigned b = 0; b < grid; ++b) {
    std::snprintf(emu_fault_message, sizeof emu_fault_message,
                  "block %u accessed dynamic shared memory past the launch's %zu bytes\n", b,
                  shared);
    std::memset(emu_smem, 0xcd, shared);  // stale shared memory must not matter
    std::memset(emu_smem + shared, kEmuCanary, room - shared);
    EmuBarrier sync{block};
    std::vector<Warp> warps((block + 31) / 32);
    blockIdx = make_uint3(b, 0, 0);
    blockDim = make_uint3(bx, by, 1);
    gridDim = make_uint3(grid, 1, 1);
    this_block = &sync;
    emu_run_block(kernel, block, b, [&](unsigned t) {
      threadIdx = make_uint3(t % bx, t / bx, 0);
      this_warp = &warps[t / 32];
    });
    for (size_t i = shared; i < room; ++i) {
      if (emu_smem[i] != kEmuCanary) {
        std::fprintf(stderr, "block %u wrote dynamic shared memory byte %zu of a %zu-byte "
                     "launch\n", b, i, shared);
        std::exit(87);
      }
    }
  }
}
#include <cuda_fp16.h>
#include <cuda_bf16.h>
"""
)

#: Declarations of dynamic shared memory the templates use, and their emulated replacement.
_DYNAMIC_SHARED = re.compile(r"extern __shared__ __align__\(16\) (\w[\w ]*?) (\w+)\[\];")

_CTYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}


@dataclass
class Case:
    """One variant at one shape and dtype, run with ``grid_cap`` blocks at most per step, every
    array argument ``offset`` of its elements past a 16-byte boundary (a view's data pointer:
    the row arrays stay congruent). With ``bounds``, a global load or store (``__ldg``,
    ``__ldcs``, ``__stcs``) outside every array argument fails the case (exit 89)."""

    spec: OperatorSpec
    config: Config
    shape: tuple[int, ...]
    dtype: str
    grid_cap: int | None = None
    offset: int = 0
    bounds: bool = False

    def __str__(self) -> str:
        cap = f" grid<={self.grid_cap}" if self.grid_cap else ""
        off = f" offset={self.offset}" if self.offset else ""
        off += " bounds" if self.bounds else ""
        return f"{self.spec.name} {self.dtype} {self.shape} {self.config}{cap}{off}"


def cuda_include_dir() -> Path | None:
    """Where nvcc finds cuda_fp16.h (from ``nvcc -dryrun``'s INCLUDES line)."""
    if shutil.which("nvcc") is None:
        return None
    proc = subprocess.run(
        ["nvcc", "-dryrun", "-cubin", "-arch=sm_90", "-x", "cu", "-o", "/dev/null", "/dev/null"],
        capture_output=True,
        text=True,
        check=False,
    )
    match = re.search(r'INCLUDES="-I([^"]+)"', proc.stdout + proc.stderr)
    return Path(match.group(1).strip()) if match else None


#: g++'s flags for every emulation program: -O0, as building the programs costs more than
#: running them (docs/ARCHITECTURE.md: -O1 took a third more CPU time over the emulation tests).
GXX_FLAGS = ("-std=c++20", "-O0", "-w")


def binary_cache_dir() -> Path | None:
    """Where built emulation programs are kept across runs: beside the compile checks' cubins
    (``KATO_TEST_CUBIN_CACHE``, default ``~/.cache/kato/test-cubins``), ``None`` when it is
    ``off``. The g++ builds were most of a warm run's time (about 9 CPU-minutes)."""
    env = os.environ.get("KATO_TEST_CUBIN_CACHE", "")
    if env == "off":
        return None
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "kato" / "test-cubins"
    return base / "emulation"


@functools.cache
def _gxx_version() -> str:
    return subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout


class HostBuild:
    """``g++`` building ``workdir/source`` into ``workdir/binary``, or the same program taken
    from :func:`binary_cache_dir` (keyed by the source, flags, include directory and the exact
    ``g++ --version``, so any change builds again). Started at once; :meth:`wait` returns
    ``(returncode, stderr)``."""

    def __init__(self, workdir: Path, source: str, binary: str, include: Path) -> None:
        self.target = workdir / binary
        text = (workdir / source).read_bytes()
        key = hashlib.sha256(
            b"\0".join(
                [text, " ".join(GXX_FLAGS).encode(), str(include).encode(), _gxx_version().encode()]
            )
        ).hexdigest()
        cache = binary_cache_dir()
        self.cached = cache / key if cache is not None else None
        self.proc: subprocess.Popen[str] | None = None
        if self.cached is not None and self.cached.is_file():
            shutil.copy2(self.cached, self.target)
            return
        self.proc = subprocess.Popen(
            ["g++", *GXX_FLAGS, f"-I{include}", source, "-o", binary],
            cwd=workdir,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait(self, timeout: float = 900) -> tuple[int, str]:
        if self.proc is None:
            return 0, ""
        _, err = self.proc.communicate(timeout=timeout)
        if self.proc.returncode == 0 and self.cached is not None:
            self.cached.parent.mkdir(parents=True, exist_ok=True)
            partial = self.cached.with_name(f"{self.cached.name}.{os.getpid()}.tmp")
            shutil.copy2(self.target, partial)
            os.replace(partial, self.cached)  # atomic: a concurrent run sees all or nothing
        return self.proc.returncode, err


def host_template(spec: OperatorSpec, config: Config) -> str:
    source = template_source(spec.template_for(config))  # the shared headers inlined
    source = _DYNAMIC_SHARED.sub(r"\1* \2 = reinterpret_cast<\1*>(emu_smem);", source)
    source = source.replace("__shared__ __align__(16)", "alignas(16) static")
    return source.replace("__shared__", "static")


def _integer_literal(value: np.generic) -> str:
    ctype = _CTYPES[np.dtype(type(value))]
    return f"({ctype}){int(value)}LL"


#: How a scalar kernel argument is written into the program (a test may widen it).
_literal = _integer_literal


#: Device functions the layernorm and batchnorm_stats templates use beyond :data:`HEADER`.
NORM_EXTRA = r"""
#include <cmath>
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
template <class V> inline V __ldcg(const V* p) { return *p; }
template <class V> inline void __stcg(V* p, V v) { *p = v; }
inline void __threadfence() {}
inline unsigned atomicInc(unsigned* p, unsigned val) {
  const unsigned old = *p;
  *p = old >= val ? 0u : old + 1u;
  return old;
}
"""


def float_literal(value: np.generic) -> str:
    """Integer scalar arguments as usual, float ones (``eps``) as float literals."""
    if isinstance(value, np.floating):
        return f"{float(value)!r}f"
    return _integer_literal(value)


def stored_values(path: Path, dtype: str) -> np.ndarray:
    """An array a case wrote (``<case dir>/a<k>.bin``) read back as float64 from its storage
    type: float32, float16, or bfloat16 (the upper half of a float32)."""
    if dtype == "float32":
        return np.fromfile(path, dtype=np.float32).astype(np.float64)
    raw = np.fromfile(path, dtype=np.uint16)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    raise ValueError(f"no float storage type {dtype!r}")


def emulation_source(cases: Sequence[Case], problems: Sequence[Problem]) -> str:
    """One program holding every case; ``prog <case> <dir>`` reads ``<dir>/a<k>.bin`` for every
    array argument k, runs the case's steps and writes the arrays back."""
    parts = [HEADER]
    dispatch = []
    for i, (case, problem) in enumerate(zip(cases, problems, strict=True)):
        spec = case.spec
        names = spec.kernel_names or (spec.kernel_name,)
        macros = spec.defines(case.config, case.shape, case.dtype)
        body = host_template(spec, case.config)
        defined = set(re.findall(r"^\s*#\s*define\s+(\w+)", body, re.MULTILINE))
        parts += [f"#define {n} {n}_{i}" for n in names]
        parts += [f"#define KATO_NS kato_emu_{i}"]
        parts += [f"#define {k} {v}" for k, v in macros.items()]
        parts.append(body)
        parts += [f"#undef {n}" for n in sorted(set(names) | set(macros) | defined | {"KATO_NS"})]
        calls = []
        for step in spec.steps(case.config, case.shape, case.dtype):
            indices = step.args if step.args is not None else range(len(problem.args))
            args = []
            for k in indices:
                a = problem.args[k]
                if isinstance(a, np.ndarray):
                    at = case.offset * a.itemsize
                    args.append(f"AnyPtr{{buf[{k}].data() + kEmuPad + {at}}}")
                else:
                    args.append(_literal(a))
            grid = step.launch.grid[0]
            if case.grid_cap:
                grid = min(grid, case.grid_cap)
            bx, by, _ = step.launch.block
            shared = step.launch.shared_bytes
            calls.append(
                f"    launch([&] {{ {step.kernel}_{i}({', '.join(args)}); }}, {grid}, {bx}, {by}, "
                f"{shared});"
            )
        # Shifted arrays: moved up by their offset for the launches, and back for the output.
        moves = [
            (
                f"buf[{k}].data() + kEmuPad",
                f"buf[{k}].data() + kEmuPad + {case.offset * a.itemsize}",
                a.nbytes,
            )
            for k, a in enumerate(problem.args)
            if isinstance(a, np.ndarray) and case.offset
        ]
        before = [f"    std::memmove({dst}, {src}, {n});" for src, dst, n in moves]
        after = [f"    std::memmove({src}, {dst}, {n});" for src, dst, n in moves]
        if case.bounds:
            ranges = [
                f"{{(uintptr_t)(buf[{k}].data() + kEmuPad + {case.offset * a.itemsize}), "
                f"(uintptr_t)(buf[{k}].data() + kEmuPad + {case.offset * a.itemsize + a.nbytes})}}"
                for k, a in enumerate(problem.args)
                if isinstance(a, np.ndarray)
            ]
            before.append(f"    emu_ranges = {{{', '.join(ranges)}}};")
            after.insert(0, "    emu_ranges.clear();")
        dispatch.append(f"  case {i}:\n" + "\n".join(before + calls + after) + "\n    break;")
    parts.append(
        "// Arrays start kEmuPad bytes into their buffer (malloc's 16-byte alignment kept), so\n"
        "// that a case may shift them by a few elements.\n"
        "constexpr long kEmuPad = 64;\n"
        "int main(int argc, char** argv) {\n"
        "  std::vector<std::vector<unsigned char>> buf(128);\n"
        "  char path[4096];\n"
        "  for (int k = 0; k < 128; ++k) {\n"
        '    std::snprintf(path, sizeof path, "%s/a%d.bin", argv[2], k);\n'
        '    FILE* f = std::fopen(path, "rb");\n'
        "    if (!f) continue;\n"
        "    std::fseek(f, 0, SEEK_END); long n = std::ftell(f); std::fseek(f, 0, SEEK_SET);\n"
        "    buf[k].resize(kEmuPad + n + 64);\n"
        "    if (std::fread(buf[k].data() + kEmuPad, 1, n, f) != (size_t)n) return 2;\n"
        "    std::fclose(f);\n"
        "  }\n"
        "  switch (std::atoi(argv[1])) {\n" + "\n".join(dispatch) + "\n  default: return 3;\n  }\n"
        "  for (int k = 0; k < 128; ++k) {\n"
        "    if (buf[k].empty()) continue;\n"
        '    std::snprintf(path, sizeof path, "%s/a%d.bin", argv[2], k);\n'
        '    FILE* f = std::fopen(path, "wb");\n'
        "    std::fwrite(buf[k].data() + kEmuPad, 1, buf[k].size() - kEmuPad - 64, f);\n"
        "    std::fclose(f);\n"
        "  }\n"
        "  return 0;\n}\n"
    )
    return "\n".join(parts)


def run_cases(
    cases: Sequence[Case], workdir: Path, rng: np.random.Generator, binaries: int = 2
) -> list[str]:
    """Build the cases into ``binaries`` programs (in parallel), run each case on fresh
    problems with poisoned outputs, compare every output with its reference exactly as the
    GPU verifier does (within the spec's tolerance, equal values always pass). Returns one line
    per failing case."""
    include = cuda_include_dir()
    assert include is not None and (include / "cuda_fp16.h").is_file(), "CUDA headers not found"
    start = time.perf_counter()
    problems = [c.spec.make_problem(c.shape, c.dtype, rng) for c in cases]
    groups = [list(range(len(cases)))[k::binaries] for k in range(binaries)]
    builds = []
    for k, group in enumerate(groups):
        src = workdir / f"emu{k}.cpp"
        src.write_text(emulation_source([cases[i] for i in group], [problems[i] for i in group]))
        builds.append(HostBuild(workdir, src.name, f"emu{k}", include))
    for build in builds:
        returncode, err = build.wait(timeout=900)
        assert returncode == 0, err[:4000]
    print(f"\nemulation: {len(cases)} cases built in {time.perf_counter() - start:.0f} s")
    failures = []
    for k, group in enumerate(groups):
        for local, i in enumerate(group):
            case, problem = cases[i], problems[i]
            data = workdir / f"case{i}"
            data.mkdir()
            for index, a in enumerate(problem.args):
                if isinstance(a, np.ndarray):
                    a.tofile(data / f"a{index}.bin")
            t0 = time.perf_counter()
            proc = subprocess.run(
                [str(workdir / f"emu{k}"), str(local), str(data)],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            if time.perf_counter() - t0 > 2:
                print(f"  slow case ({time.perf_counter() - t0:.1f} s): {case}")
            if proc.returncode != 0:
                failures.append(f"{case}: exit {proc.returncode} {proc.stderr[:300]}")
                continue
            tolerances = problem.tolerances or [case.spec.tolerance(case.dtype)] * len(
                problem.outputs
            )
            for out, ref, (atol, rtol) in zip(
                problem.outputs, problem.references, tolerances, strict=True
            ):
                a = problem.args[out]
                got = np.fromfile(data / f"a{out}.bin", dtype=a.dtype).reshape(a.shape)
                error = compare(got, ref, atol, rtol)
                if error:
                    failures.append(f"{case}: output {out}: {error}")
    return failures


def compare(got: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> str | None:
    """The GPU verifier's rule: integers exactly, floats equal or finite within tolerance."""
    if got.dtype.kind in "iu":
        bad = got.astype(np.int64) != ref.astype(np.int64)
    else:
        y = got.astype(np.float64)
        r = ref.astype(np.float32).astype(np.float64)
        with np.errstate(invalid="ignore"):
            ok = (y == r) | (np.isfinite(y) & (np.abs(y - r) <= atol + rtol * np.abs(r)))
        bad = ~ok
    if bad.any():
        first = np.argwhere(bad)[0]
        return f"{int(bad.sum())} of {bad.size} wrong, first at {tuple(first)}"
    return None
