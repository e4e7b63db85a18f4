"""tuner.nvcc: compiling to cubin, ptxas resource parsing, the on-disk cache, compile_many."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import threading
import time
from pathlib import Path

import pytest
from kato.tuner import nvcc as nvcc_module
from kato.tuner.compile_slots import Urgency, Want, wanting
from kato.tuner.nvcc import (
    CompiledKernel,
    CompileError,
    CompileJob,
    NvccNotFoundError,
    compile_cache_dir,
    compile_kernel,
    compile_many,
    cuda_version,
    nvcc_available,
    parse_ptxas_report,
)

needs_nvcc = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

TINY = """
extern "C" __global__ void scale(const float* __restrict__ x, float* __restrict__ y, int n) {
  __shared__ float tile[128];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  tile[threadIdx.x & 127] = i < n ? x[i] : 0.0f;
  __syncthreads();
  if (i < n) y[i] = 2.0f * tile[(threadIdx.x + 1) & 127];
}
"""

# Two kernels, one C++-mangled; a local array indexed at run time lives in the stack frame.
TWO_KERNELS = """
extern "C" __global__ void __launch_bounds__(256, 4) first(float* y, int k) {
  float a[32];
  for (int j = 0; j < 32; ++j) a[(j * k) & 31] = y[j];
  y[threadIdx.x] = a[k & 31];
}
__global__ void mangled(float* y) { y[0] = 1.0f; }
"""

BROKEN = """
extern "C" __global__ void broken(float* y) { y[0] = undefined_identifier; }
"""

# Captured from nvcc 13.0 (``nvcc -cubin -arch=sm_80 -Xptxas -v``).
PTXAS_REPORT = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z5otherPf' for 'sm_80'
ptxas info    : Function properties for _Z5otherPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]
ptxas info    : Compile time = 2.548 ms
ptxas info    : Compiling entry function 'k' for 'sm_80'
ptxas info    : Function properties for k
    160 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 160 bytes cumulative stack size, \
256 bytes smem, 372 bytes cmem[0]
ptxas info    : Compile time = 55.711 ms
"""


# --- parsing (no nvcc needed) -----------------------------------------------------------------


def test_parse_ptxas_report() -> None:
    entries = parse_ptxas_report(PTXAS_REPORT)
    assert set(entries) == {"_Z5otherPf", "k"}
    k = entries["k"]
    assert (k.registers, k.shared_static_bytes, k.local_bytes, k.spill_bytes) == (64, 256, 160, 32)
    other = entries["_Z5otherPf"]
    assert (other.registers, other.shared_static_bytes, other.spill_bytes) == (8, 0, 0)


def test_parse_ptxas_report_without_entries() -> None:
    assert parse_ptxas_report("") == {}
    assert parse_ptxas_report("ptxas info    : 0 bytes gmem\n") == {}


def test_compile_error_pickles_with_its_log() -> None:
    error = pickle.loads(pickle.dumps(CompileError("boom", log="line 1: error")))
    assert isinstance(error, CompileError)
    assert str(error) == "boom" and error.log == "line 1: error"


def test_default_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KATO_COMPILE_CACHE", "/somewhere/cubins")
    assert compile_cache_dir() == Path("/somewhere/cubins")
    monkeypatch.delenv("KATO_COMPILE_CACHE")
    assert compile_cache_dir() == Path.home() / ".cache" / "kato" / "cubin"


def test_missing_nvcc_is_reported_as_such(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-nvcc-here")
    assert not nvcc_available(missing)
    with pytest.raises(NvccNotFoundError):
        cuda_version(missing)
    with pytest.raises(NvccNotFoundError):
        compile_kernel(TINY, "scale", cache_dir=tmp_path, nvcc=missing)


def test_nvcc_runs_niced_so_compiles_ahead_leave_the_cores_to_the_search(tmp_path: Path) -> None:
    # A stand-in nvcc that answers --version and, when compiling, records its niceness.
    seen = tmp_path / "niceness"
    fake = tmp_path / "nvcc"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fake nvcc, release 13.0"; exit 0; fi\n'
        f"nice > {seen}\n"
        "echo 'error: stand-in' >&2; exit 2\n"
    )
    fake.chmod(0o755)
    with pytest.raises(CompileError, match="exit 2"):
        compile_kernel(TINY, "scale", cache_dir=tmp_path, nvcc=str(fake), use_cache=False)
    expected = min(19, os.nice(0) + nvcc_module.COMPILE_NICENESS)
    assert int(seen.read_text()) == expected
    # A speculative compile (another job's space, compiled ahead) runs lower still.
    with wanting(Want(Urgency.BULK)), pytest.raises(CompileError, match="exit 2"):
        compile_kernel(TINY, "scale", cache_dir=tmp_path, nvcc=str(fake), use_cache=False)
    assert int(seen.read_text()) == min(19, os.nice(0) + nvcc_module.SPECULATIVE_NICENESS)
    assert nvcc_module.SPECULATIVE_NICENESS > nvcc_module.COMPILE_NICENESS


def test_nvcc_gone_after_its_version_was_read_is_still_reported_as_missing(
    tmp_path: Path,
) -> None:
    # Its --version is cached (part of every cache key): the compile itself must notice.
    fake = tmp_path / "nvcc"
    fake.write_text('#!/bin/sh\necho "fake nvcc, release 13.0"\n')
    fake.chmod(0o755)
    assert cuda_version(str(fake)) == "13.0"
    fake.unlink()
    with pytest.raises(NvccNotFoundError):
        compile_kernel(TINY, "scale", cache_dir=tmp_path, nvcc=str(fake), use_cache=False)


def test_a_relative_nvcc_path_runs_from_the_compile_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nvcc runs in a temporary directory: a path relative to the caller's must be made absolute
    # there, or every config would be a compile error (nice's exit 127).
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "nvcc"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fake nvcc, release 13.0"; exit 0; fi\n'
        "echo 'error: stand-in ran' >&2; exit 2\n"
    )
    fake.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CompileError, match="stand-in ran"):
        compile_kernel(TINY, "scale", cache_dir=tmp_path, nvcc="bin/nvcc", use_cache=False)


def test_bad_arch_is_a_compile_error(tmp_path: Path) -> None:
    with pytest.raises(CompileError, match="arch must look like"):
        compile_kernel(TINY, "scale", arch="compute_90", cache_dir=tmp_path)


# --- compiling --------------------------------------------------------------------------------


@needs_nvcc
def test_cuda_version() -> None:
    version = cuda_version()
    major, minor = version.split(".")
    assert int(major) >= 11 and minor.isdigit()


@needs_nvcc
def test_compile_reads_resources(tmp_path: Path) -> None:
    kernel = compile_kernel(TINY, "scale", arch="sm_90", cache_dir=tmp_path)
    assert isinstance(kernel, CompiledKernel)
    assert kernel.cubin[:4] == b"\x7fELF"
    assert kernel.kernel_name == "scale" and kernel.arch == "sm_90"
    assert 1 <= kernel.registers <= 255
    assert kernel.shared_static_bytes == 128 * 4
    assert kernel.local_bytes == 0 and kernel.spill_bytes == 0
    assert kernel.compile_time_s > 0
    assert not kernel.cached
    assert len(kernel.source_hash) == 64
    assert "Used" in kernel.log
    assert [e.name for e in kernel.entries] == ["scale"]


@needs_nvcc
def test_second_compile_is_a_cache_hit(tmp_path: Path) -> None:
    first = compile_kernel(TINY, "scale", arch="sm_80", cache_dir=tmp_path)
    second = compile_kernel(TINY, "scale", arch="sm_80", cache_dir=tmp_path)
    assert not first.cached and second.cached
    assert second.cubin == first.cubin
    assert second.source_hash == first.source_hash
    assert (second.registers, second.shared_static_bytes, second.entries) == (
        first.registers,
        first.shared_static_bytes,
        first.entries,
    )
    assert second.compile_time_s == first.compile_time_s  # the original build's time
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{first.source_hash}.cubin", f"{first.source_hash}.json"]  # no temp files
    meta = json.loads((tmp_path / f"{first.source_hash}.json").read_text())
    assert meta["registers"] == first.registers and "cubin" not in meta


@needs_nvcc
def test_cache_key_covers_arch_options_and_source(tmp_path: Path) -> None:
    base = compile_kernel(TINY, "scale", arch="sm_80", cache_dir=tmp_path)
    other_arch = compile_kernel(TINY, "scale", arch="sm_90", cache_dir=tmp_path)
    with_option = compile_kernel(TINY, "scale", "sm_80", ("-DUNUSED=1",), cache_dir=tmp_path)
    other_source = compile_kernel(TINY + "\n// edit\n", "scale", "sm_80", cache_dir=tmp_path)
    hashes = {k.source_hash for k in (base, other_arch, with_option, other_source)}
    assert len(hashes) == 4
    assert not any(k.cached for k in (other_arch, with_option, other_source))


@needs_nvcc
def test_corrupt_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    first = compile_kernel(TINY, "scale", cache_dir=tmp_path)
    (tmp_path / f"{first.source_hash}.cubin").write_bytes(b"truncated")
    again = compile_kernel(TINY, "scale", cache_dir=tmp_path)
    assert not again.cached and again.cubin == first.cubin
    (tmp_path / f"{first.source_hash}.json").write_text("{not json")
    assert not compile_kernel(TINY, "scale", cache_dir=tmp_path).cached
    assert compile_kernel(TINY, "scale", cache_dir=tmp_path).cached


@needs_nvcc
def test_use_cache_false_neither_reads_nor_writes(tmp_path: Path) -> None:
    kernel = compile_kernel(TINY, "scale", cache_dir=tmp_path, use_cache=False)
    assert not kernel.cached
    assert list(tmp_path.iterdir()) == []


@needs_nvcc
def test_default_cache_dir_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KATO_COMPILE_CACHE", str(tmp_path / "env-cache"))
    kernel = compile_kernel(TINY, "scale")
    assert (tmp_path / "env-cache" / f"{kernel.source_hash}.cubin").is_file()


@needs_nvcc
def test_several_kernels_local_memory_and_launch_bounds(tmp_path: Path) -> None:
    kernel = compile_kernel(TWO_KERNELS, "first", arch="sm_90", cache_dir=tmp_path)
    assert kernel.registers * 256 * 4 <= 65536  # __launch_bounds__(256, 4) honoured
    assert kernel.local_bytes >= 32 * 4  # the run-time indexed array lives in the stack frame
    assert {e.name for e in kernel.entries} == {"first", "_Z7mangledPf"}
    assert kernel.resources("first").registers == kernel.registers
    with pytest.raises(KeyError):
        kernel.resources("nope")


@needs_nvcc
def test_mangled_or_missing_kernel_name_is_a_compile_error(tmp_path: Path) -> None:
    with pytest.raises(CompileError, match='extern "C"') as info:
        compile_kernel(TWO_KERNELS, "mangled", cache_dir=tmp_path)
    assert "_Z7mangledPf" in info.value.log


@needs_nvcc
def test_bad_source_raises_compile_error_with_the_log(tmp_path: Path) -> None:
    with pytest.raises(CompileError) as info:
        compile_kernel(BROKEN, "broken", cache_dir=tmp_path)
    assert "undefined_identifier" in info.value.log
    assert "error" in str(info.value)
    assert len(info.value.log) <= nvcc_module.LOG_LIMIT
    assert list(tmp_path.iterdir()) == []  # failures are not cached


@needs_nvcc
def test_log_is_truncated(tmp_path: Path) -> None:
    noisy = "\n".join(f"int bad_{i} = undefined_{i};" for i in range(400))
    with pytest.raises(CompileError) as info:
        compile_kernel(noisy, "k", cache_dir=tmp_path)
    assert len(info.value.log) <= nvcc_module.LOG_LIMIT
    assert "characters cut" in info.value.log
    assert "undefined_0" in info.value.log  # the first error survives


@needs_nvcc
def test_nvcc_timeout_is_a_compile_error(tmp_path: Path) -> None:
    with pytest.raises(CompileError, match="timed out"):
        compile_kernel(TINY, "scale", cache_dir=tmp_path, use_cache=False, timeout_s=0.001)


# --- compile_many -----------------------------------------------------------------------------


@needs_nvcc
def test_compile_many_dedupes_and_keeps_order(tmp_path: Path) -> None:
    jobs = [
        (TINY, "scale", "sm_90", ()),
        CompileJob(BROKEN, "broken", "sm_90"),
        (TINY, "scale", "sm_80"),  # options may be left out
        CompileJob(TINY, "scale", "sm_90"),  # same key as the first job
    ]
    results = compile_many(jobs, max_workers=2, cache_dir=tmp_path)
    assert len(results) == 4
    assert isinstance(results[0], CompiledKernel) and results[0].arch == "sm_90"
    assert isinstance(results[1], CompileError) and "undefined_identifier" in results[1].log
    assert isinstance(results[2], CompiledKernel) and results[2].arch == "sm_80"
    assert results[3] is results[0]  # compiled once
    assert len(list(tmp_path.glob("*.cubin"))) == 2
    again = compile_many(jobs, max_workers=2, cache_dir=tmp_path)
    assert again[0].cached and again[2].cached


@needs_nvcc
def test_compile_many_in_this_thread_with_one_worker(tmp_path: Path) -> None:
    results = compile_many([(TINY, "scale", "sm_90", ())], max_workers=1, cache_dir=tmp_path)
    assert isinstance(results[0], CompiledKernel)
    assert compile_many([], cache_dir=tmp_path) == []


@needs_nvcc
def test_compile_many_on_a_process_pool(tmp_path: Path) -> None:
    """A caller's own ProcessPoolExecutor works: jobs and results (errors too) pickle."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    jobs = [(TINY, "scale", "sm_90", ()), (BROKEN, "broken", "sm_90", ())]
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=context) as pool:
        results = compile_many(jobs, cache_dir=tmp_path, executor=pool)
    assert isinstance(results[0], CompiledKernel) and results[0].registers > 0
    assert isinstance(results[1], CompileError) and "undefined_identifier" in results[1].log


@needs_nvcc
def test_parallel_writers_share_one_cache(tmp_path: Path) -> None:
    """Threads racing to compile the same key all get a valid kernel; the entry is whole."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        kernels = list(
            pool.map(lambda _: compile_kernel(TINY, "scale", cache_dir=tmp_path), range(4))
        )
    assert len({k.cubin for k in kernels}) == 1
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"{kernels[0].source_hash}.cubin", f"{kernels[0].source_hash}.json"]
    )


@needs_nvcc
def test_callers_compiling_one_source_at_once_run_nvcc_once(tmp_path: Path) -> None:
    """Several jobs of a worker asking for the same rendered source at once (a template that
    takes the shape at run time): one nvcc run, every caller gets its cubin."""
    source = TINY.replace("2.0f", "3.0f")  # a source no other test has cached
    before = nvcc_module.compile_stats()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(compile_kernel, source, "scale", "sm_90", cache_dir=tmp_path)
            for _ in range(4)
        ]
        kernels = [f.result() for f in futures]
    after = nvcc_module.compile_stats()
    assert after["nvcc_runs"] - before["nvcc_runs"] == 1
    assert len({k.cubin for k in kernels}) == 1 and len({k.source_hash for k in kernels}) == 1
    assert sum(not k.cached for k in kernels) == 1  # the others read the first one's cubin


def test_a_caller_waiting_for_another_callers_compile_raises_its_urgency() -> None:
    """A measurement (NOW) that waits for another job's speculative (BULK) compile of the same
    source lends it its urgency: the leader's nvcc slot is not handed out as a BULK one."""
    led, follow_started, release = threading.Event(), threading.Event(), threading.Event()
    bulk = Want(Urgency.BULK)

    def lead() -> None:
        with wanting(bulk), nvcc_module._IN_FLIGHT.leader("review-key") as leads:
            assert leads
            led.set()
            release.wait(5)

    def follow() -> None:
        follow_started.set()
        with nvcc_module._IN_FLIGHT.leader("review-key") as leads:  # this thread: NOW
            assert not leads

    leader = threading.Thread(target=lead, daemon=True)
    leader.start()
    assert led.wait(5)
    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    assert follow_started.wait(5)
    deadline = time.monotonic() + 5
    while bulk.urgency is not Urgency.NOW and time.monotonic() < deadline:
        time.sleep(0.005)
    assert bulk.urgency is Urgency.NOW
    release.set()
    leader.join(5)
    follower.join(5)
