"""float32 matmul's split-K clusters (``SPLIT_K`` 2-4, kernels/matmul/matmul.cu) run on the CPU.

The host-C++ emulation of tests/kernels/cuda_emulation.py runs one block at a time, so it cannot
run a cluster: here the CTAs of one cluster run together, one fiber per thread of each, with a
block barrier per CTA (``__syncthreads``), one cluster barrier over all of them
(``barrier.cluster.arrive.release`` + ``wait.acquire``) and ``%cluster_ctarank``, ``mapa`` and
``ld.shared::cluster`` emulated on per-CTA dynamic shared memory of exactly the launch's
``shared_bytes``, each ending at an inaccessible page. So a case fails where a CTA of a cluster
returns or skips a cluster barrier while the others wait (exit 84), touches shared memory past
what the launch gives it (86; 87 for the bytes up to the next multiple of 16), reads another
CTA's shared memory after that CTA exited (90), loads outside A, B and C (89), or is launched
on a grid.x that is no multiple of the cluster size (93, the driver's refusal); and where a k
range is missing or counted twice, a partial sum is read before its writer released it, or a
row is stored by no CTA (C starts as NaN), through the comparison with the float64 reference.
What it cannot check is the hardware's scheduling and memory model beyond the barriers' order.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cuda_emulation import HEADER, HostBuild, compare, cuda_include_dir, host_template
from kato.kernels import get_operator
from kato.kernels.matmul import MMA_PINNED

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or cuda_include_dir() is None,
    reason="needs g++ and the CUDA headers next to nvcc",
)

NN, NT, TN = (get_operator(name) for name in ("matmul", "matmul_nt", "matmul_tn"))

CLUSTERS = r"""
#include <cmath>
#define __cluster_dims__(...)
// Thread block clusters: the CTAs of one cluster run as the fibers of one emu_run_block, CTA
// r's threads r * block .. (r + 1) * block - 1.
constexpr unsigned kEmuMaxCluster = 8;
unsigned char* emu_cta_smem[kEmuMaxCluster];   // each CTA's dynamic shared memory
unsigned char* emu_cta_guard[kEmuMaxCluster];  // the inaccessible page after it
unsigned emu_cta_running[kEmuMaxCluster];      // threads of the CTA that have not returned
size_t emu_cta_shared;                         // the launch's dynamic shared bytes
unsigned emu_cluster_size, emu_cta;            // the running fiber's CTA rank
EmuBarrier* emu_cluster;
inline unsigned emu_cluster_rank() { return emu_cta; }
inline void emu_cluster_sync() { emu_cluster->arrive_and_wait(); }
inline size_t __cvta_generic_to_shared(const void* p) {
  const unsigned char* at = static_cast<const unsigned char*>(p);
  if (at < emu_smem || at > emu_smem + emu_cta_shared) {
    std::fprintf(stderr, "__cvta_generic_to_shared of an address outside shared memory\n");
    std::_Exit(91);
  }
  return static_cast<size_t>(at - emu_smem);
}
// mapa: CTA `rank`'s copy of shared address `addr`, as rank << 24 | addr.
inline unsigned emu_mapa(unsigned addr, unsigned rank) {
  if (rank >= emu_cluster_size) {
    std::fprintf(stderr, "mapa to CTA %u of a cluster of %u\n", rank, emu_cluster_size);
    std::_Exit(92);
  }
  return rank << 24 | addr;
}
inline void emu_ld_cluster_v4(unsigned remote, float& x, float& y, float& z, float& w) {
  const unsigned rank = remote >> 24, offset = remote & 0xffffffu;
  if (emu_cta_running[rank] == 0) {
    std::fprintf(stderr, "CTA %u read the shared memory of CTA %u, which has exited\n",
                 emu_cta, rank);
    std::_Exit(90);
  }
  if (offset % 16 != 0 || offset + 16 > emu_cta_shared) {
    std::fprintf(stderr, "ld.shared::cluster.v4 at %u of %zu bytes\n", offset,
                 emu_cta_shared);
    std::_Exit(86);
  }
  float v[4];
  std::memcpy(v, emu_cta_smem[rank] + offset, 16);
  x = v[0], y = v[1], z = v[2], w = v[3];
}
inline void emu_cluster_fault(int, siginfo_t* info, void*) {
  const unsigned char* at = static_cast<const unsigned char*>(info->si_addr);
  bool guard = false;
  for (unsigned r = 0; r < kEmuMaxCluster; ++r) {
    guard |= emu_cta_guard[r] && at >= emu_cta_guard[r] && at < emu_cta_guard[r] + emu_page;
  }
  const char* text = guard ? "a CTA accessed dynamic shared memory past the launch's bytes\n"
                           : "SIGSEGV outside dynamic shared memory\n";
  if (write(2, text, std::strlen(text)) < 0) _exit(86);
  _exit(guard ? 86 : 139);
}
// Runs the gx x gy grid of `block`-thread CTAs in clusters of `cluster` consecutive CTAs along
// x (__cluster_dims__(cluster, 1, 1)), one cluster after another, its CTAs together.
template <class F>
void launch_clusters(F kernel, unsigned gx, unsigned gy, unsigned block, size_t shared,
                     unsigned cluster) {
  if (cluster == 0 || cluster > kEmuMaxCluster || gx % cluster != 0) {
    std::fprintf(stderr, "grid.x %u is not a multiple of the cluster size %u\n", gx, cluster);
    std::exit(93);
  }
  if (shared > kEmuSmemMax) std::exit(85);
  if (!emu_page) {
    emu_page = sysconf(_SC_PAGESIZE);
    const size_t room = (kEmuSmemMax + 16 + emu_page - 1) / emu_page * emu_page;
    for (unsigned r = 0; r < kEmuMaxCluster; ++r) {
      void* base = mmap(nullptr, room + emu_page, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base == MAP_FAILED) std::abort();
      emu_cta_guard[r] = static_cast<unsigned char*>(base) + room;
      if (mprotect(emu_cta_guard[r], emu_page, PROT_NONE) != 0) std::abort();
    }
    struct sigaction action {};
    action.sa_sigaction = emu_cluster_fault;
    action.sa_flags = SA_SIGINFO;
    sigaction(SIGSEGV, &action, nullptr);
  }
  const size_t room = (shared + 15) / 16 * 16;
  emu_cta_shared = shared;
  emu_cluster_size = cluster;
  for (unsigned r = 0; r < cluster; ++r) emu_cta_smem[r] = emu_cta_guard[r] - room;
  gridDim = make_uint3(gx, gy, 1);
  blockDim = make_uint3(block, 1, 1);
  for (unsigned by = 0; by < gy; ++by) {
    for (unsigned c = 0; c < gx / cluster; ++c) {
      std::vector<EmuBarrier> ctas(cluster, EmuBarrier{block});
      EmuBarrier all{cluster * block};
      emu_cluster = &all;
      std::vector<Warp> warps(cluster * ((block + 31) / 32));
      for (unsigned r = 0; r < cluster; ++r) {
        std::memset(emu_cta_smem[r], 0xcd, shared);  // stale shared memory must not matter
        std::memset(emu_cta_smem[r] + shared, kEmuCanary, room - shared);
        emu_cta_running[r] = block;
      }
      auto body = [&] {
        kernel();
        --emu_cta_running[emu_cta];
      };
      emu_run_block(body, cluster * block, by * (gx / cluster) + c, [&](unsigned t) {
        emu_cta = t / block;
        threadIdx = make_uint3(t % block, 0, 0);
        blockIdx = make_uint3(c * cluster + emu_cta, by, 0);
        this_warp = &warps[emu_cta * ((block + 31) / 32) + t % block / 32];
        this_block = &ctas[emu_cta];
        emu_smem = emu_cta_smem[emu_cta];
      });
      for (unsigned r = 0; r < cluster; ++r) {
        for (size_t i = shared; i < room; ++i) {
          if (emu_cta_smem[r][i] != kEmuCanary) {
            std::fprintf(stderr, "CTA %u wrote dynamic shared memory byte %zu of %zu\n", r, i,
                         shared);
            std::exit(87);
          }
        }
      }
    }
  }
}
"""

#: The template's cluster PTX (the float32 path's split-K helpers) -> the emulation's functions.
_PTX = [
    (
        r'asm volatile\("mov\.u32 %0, %%cluster_ctarank;"\s*:\s*"=r"\((\w+)\)\);',
        r"\1 = emu_cluster_rank();",
    ),
    (
        r'asm volatile\(\s*"barrier\.cluster\.arrive\.release\.aligned;\\n"\s*'
        r'"barrier\.cluster\.wait\.acquire\.aligned;"\s*:::\s*"memory"\);',
        "emu_cluster_sync();",
    ),
    (
        r'asm volatile\("mapa\.shared::cluster\.u32 %0, %1, %2;"\s*:\s*"=r"\((\w+)\)\s*:\s*'
        r'"r"\((\w+)\),\s*"r"\((\w+)\)\);',
        r"\1 = emu_mapa(\2, \3);",
    ),
    (
        r'asm volatile\("ld\.shared::cluster\.v4\.f32 \{%0, %1, %2, %3\}, \[%4\];"\s*:\s*'
        r'"=f"\(([\w.]+)\),\s*"=f"\(([\w.]+)\),\s*"=f"\(([\w.]+)\),\s*"=f"\(([\w.]+)\)\s*:\s*'
        r'"r"\((\w+)\)\s*:\s*"memory"\);',
        r"emu_ld_cluster_v4(\5, \1, \2, \3, \4);",
    ),
]


def emulated_template(spec, config) -> str:
    """The host template with the split-K helpers' PTX replaced (each statement found once)."""
    source = host_template(spec, config)
    for pattern, replacement in _PTX:
        source, count = re.subn(pattern, replacement, source)
        assert count == 1, (pattern, count)
    return source


def _fp32(bm, bn, wm, wn, tm, tn, bk, vec, stages, pad, split):
    return {
        "BM": bm, "BN": bn, "BK": bk, "WM": wm, "WN": wn, "TM": tm, "TN": tn, "VEC": vec,
        "STAGES": stages, "PAD": pad, "MIN_BLOCKS": 0, "ENGINE": "mma",
        **{**MMA_PINNED, "SPLIT_K": split},
    }  # fmt: skip


#: (spec, config, shape): every float32 tile that splits, SPLIT_K 2, 3 and 4 (the rows
#: i % SPLIT_K of 4- and 8-row thread tiles), both STAGES, VEC 4 and 1, each layout aligned and
#: not; one k tile per CTA (3 over 3, 4 over 4), uneven ranges (9 over 4, 4 over 3), a grid of
#: two 8-row groups whose last one is smaller (clusters past it return at once), and partial
#: sums larger than the stages (BM * BN * 4 bytes).
CASES = [
    (NN, _fp32(64, 64, 16, 32, 4, 4, 16, 4, 2, 4, 2), (70, 75, 37)),
    (NN, _fp32(128, 128, 32, 64, 8, 8, 8, 4, 1, 4, 3), (130, 132, 41)),
    (NN, _fp32(128, 128, 64, 32, 8, 8, 16, 4, 2, 4, 3), (129, 60, 52)),
    (NN, _fp32(128, 64, 32, 64, 8, 8, 16, 4, 1, 4, 2), (260, 100, 36)),
    (NN, _fp32(64, 128, 32, 64, 8, 8, 16, 4, 2, 0, 4), (520, 130, 64)),
    (NT, _fp32(128, 128, 32, 32, 8, 4, 8, 1, 2, 4, 4), (131, 129, 67)),
    (NT, _fp32(128, 128, 64, 32, 8, 8, 8, 4, 2, 4, 3), (100, 260, 24)),
    (NT, _fp32(128, 64, 32, 64, 8, 8, 16, 4, 1, 4, 2), (136, 68, 36)),
    (TN, _fp32(64, 128, 32, 64, 8, 8, 16, 4, 2, 0, 4), (520, 130, 64)),
    (TN, _fp32(128, 64, 32, 64, 8, 8, 8, 4, 1, 0, 3), (67, 131, 48)),
    (TN, _fp32(64, 64, 16, 32, 4, 4, 8, 1, 2, 0, 2), (70, 75, 37)),
]


def emulation_source(cases) -> str:
    """One program of every case: ``prog <case> <dir>`` reads A, B and C from ``<dir>/a0.bin``
    .. ``a2.bin``, launches the case's clusters and writes C back."""
    parts = [HEADER, CLUSTERS]
    dispatch = []
    for i, (spec, config, shape) in enumerate(cases):
        macros = spec.defines(config, shape, "float32")
        body = emulated_template(spec, config)
        defined = set(re.findall(r"^\s*#\s*define\s+(\w+)", body, re.MULTILINE))
        parts += [f"#define {spec.kernel_name} {spec.kernel_name}_{i}", f"#define KATO_NS kato_{i}"]
        parts += [f"#define {k} {v}" for k, v in macros.items()]
        parts.append(body)
        parts += [f"#undef {n}" for n in sorted({spec.kernel_name, "KATO_NS", *macros, *defined})]
        (step,) = spec.steps(config, shape, "float32")
        launch = step.launch
        m, n, k = shape
        assert launch.grid[2] == 1 and launch.block[1:] == (1, 1)
        dispatch.append(
            f"  case {i}: launch_clusters([&] {{ {step.kernel}_{i}((float*)a[0], (float*)a[1], "
            f"(float*)a[2], {m}, {n}, {k}); }}, {launch.grid[0]}, {launch.grid[1]}, "
            f"{launch.block[0]}, {launch.shared_bytes}, {config['SPLIT_K']}); break;"
        )
    parts.append(
        "int main(int argc, char** argv) {\n"
        "  std::vector<std::vector<unsigned char>> buf(3);\n"
        "  void* a[3];\n"
        "  char path[4096];\n"
        "  for (int k = 0; k < 3; ++k) {\n"
        '    std::snprintf(path, sizeof path, "%s/a%d.bin", argv[2], k);\n'
        '    FILE* f = std::fopen(path, "rb");\n'
        "    std::fseek(f, 0, SEEK_END); long n = std::ftell(f); std::fseek(f, 0, SEEK_SET);\n"
        "    buf[k].resize(n);\n"
        "    if (std::fread(buf[k].data(), 1, n, f) != (size_t)n) return 2;\n"
        "    std::fclose(f);\n"
        "    a[k] = buf[k].data();\n"
        "    emu_ranges.push_back({(uintptr_t)a[k], (uintptr_t)a[k] + n});\n"
        "  }\n"
        "  switch (std::atoi(argv[1])) {\n" + "\n".join(dispatch) + "\n  default: return 3;\n  }\n"
        '  std::snprintf(path, sizeof path, "%s/a2.bin", argv[2]);\n'
        '  FILE* f = std::fopen(path, "wb");\n'
        "  std::fwrite(buf[2].data(), 1, buf[2].size(), f);\n"
        "  std::fclose(f);\n"
        "  return 0;\n}\n"
    )
    return "\n".join(parts)


def run(cases, workdir: Path) -> list[str]:
    """Build the cases into one program, run each on a fresh problem (C pre-filled with NaN) and
    compare C with the float64 reference within the spec's tolerance: one line per failure."""
    include = cuda_include_dir()
    rng = np.random.default_rng(31)
    problems = [spec.make_problem(shape, "float32", rng) for spec, _, shape in cases]
    (workdir / "split.cpp").write_text(emulation_source(cases))
    returncode, err = HostBuild(workdir, "split.cpp", "split", include).wait(timeout=900)
    assert returncode == 0, err[:4000]
    failures = []
    for i, ((spec, config, shape), problem) in enumerate(zip(cases, problems, strict=True)):
        data = workdir / f"case{i}"
        data.mkdir()
        for k in range(3):
            problem.args[k].tofile(data / f"a{k}.bin")
        proc = subprocess.run(
            [str(workdir / "split"), str(i), str(data)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        name = f"{spec.name} {shape} {config}"
        if proc.returncode != 0:
            failures.append(f"{name}: exit {proc.returncode} {proc.stderr[:300]}")
            continue
        c = problem.args[2]
        got = np.fromfile(data / "a2.bin", dtype=c.dtype).reshape(c.shape)
        atol, rtol = problem.tolerances[0]
        error = compare(got, problem.references[0], atol, rtol)
        if error:
            failures.append(f"{name}: {error}")
    return failures


def test_split_k_clusters_on_the_cpu(tmp_path: Path) -> None:
    for spec, config, shape in CASES:
        assert spec.check(config, shape, "float32") is None, (spec.name, config, shape)
    assert {c["SPLIT_K"] for _, c, _ in CASES} == {2, 3, 4}
    tiles = {tuple(c[p] for p in ("BM", "BN", "WM", "WN", "TM", "TN")) for _, c, _ in CASES}
    # every FP32_TILES entry but the 512-thread 8 x 8 ones, which the reduction's registers
    # push over the launch bounds (check() keeps SPLIT_K 1 there)
    assert len(tiles) == 6
    failures = run(CASES, tmp_path)
    assert not failures, "\n".join(failures)
