"""Compile CUDA source to a cubin with nvcc, read ptxas's resource usage, cache on disk.

No GPU and no CUDA driver are needed here: only the ``nvcc`` executable (and the ``ptxas`` it
calls). A compiled kernel is keyed by everything that changes the binary (source, kernel name,
arch, options and the exact ``nvcc --version`` text), so a cache entry is never stale.

Cache layout: ``<cache_dir>/<key>.cubin`` plus ``<key>.json`` (resource usage and a checksum of
the cubin). Both are written to a temporary file and renamed into place, cubin first, so that a
reader sees either no entry or a complete one; several processes may share one directory.

Exceptions: :class:`CompileError` (the source does not compile, or the kernel is not in it; a
fact about the config) and :class:`NvccNotFoundError` (no usable nvcc; a fact about the machine).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from kato.tuner.compile_slots import Urgency, Want, current_want, nvcc_slots, release_passed

from kato.errors import KatoError
from kato.shared.paths import compile_cache_dir

__all__ = [
    "CompileError",
    "CompileJob",
    "CompiledKernel",
    "KernelResources",
    "NvccNotFoundError",
    "compile_kernel",
    "compile_many",
    "cuda_version",
    "nvcc_available",
    "parse_ptxas_report",
]

#: Bump when the cache's JSON layout or the parsing changes: old entries then stop matching.
_CACHE_FORMAT = 1
#: nvcc's log is kept up to this many characters (the start holds the first, real error).
LOG_LIMIT = 4096
#: Options every compile gets; ``options`` are appended (and may override, e.g. ``-O2``).
BASE_OPTIONS = ("-O3", "-std=c++17", "-Xptxas", "-v")
#: nvcc (and its cicc and ptxas) run at this niceness. A tuning job compiles ahead on every
#: core but one while its search proposes, its database writes land and its measuring process
#: launches kernels: at the same priority the compiles took their share of the cores from that
#: critical path (a replayed 100-trial job beside 4 busy processes on 2 cores: 9.7 s, beside
#: the same at niceness 10: 5.7 s, alone: 5.3 s). Niced, they use only what the rest leaves.
COMPILE_NICENESS = 10
#: A speculative compile (the rest of a job's space, :attr:`Urgency.BULK`) runs at the lowest
#: priority: already running when another job's measurement starts waiting on a compile, it
#: must not take the cores that compile needs. One raised after nvcc started (a measurement
#: takes it) keeps this niceness: an unprivileged process cannot lower it again.
SPECULATIVE_NICENESS = 19


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one entry function (see :class:`CompiledKernel` for units)."""

    name: str
    registers: int
    shared_static_bytes: int
    local_bytes: int
    spill_bytes: int


@dataclass(frozen=True)
class CompiledKernel:
    """A cubin and what ptxas reported for its kernel.

    Attributes:
        cubin: the binary, loadable with ``cuModuleLoadData``.
        kernel_name: the ``extern "C"`` entry point the resources belong to.
        arch: target, e.g. ``"sm_90"``.
        registers: registers per thread.
        shared_static_bytes: static shared memory per block (dynamic comes from the launch).
        local_bytes: stack frame per thread (local arrays and spill slots).
        spill_bytes: spill stores + spill loads reported by ptxas (0 when nothing spills).
        compile_time_s: seconds nvcc took to build it; on a cache hit, the original build's.
        cached: served from the on-disk cache, nvcc not run.
        source_hash: the cache key (sha256 hex of everything that determines the binary).
        log: nvcc/ptxas output (warnings, the ``-v`` report), truncated to ``LOG_LIMIT``.
        entries: resources of every entry function in the cubin, ``kernel_name``'s included
            (a module may hold several kernels; the compile test builds variants in batches).
    """

    cubin: bytes
    kernel_name: str
    arch: str
    registers: int
    shared_static_bytes: int
    local_bytes: int
    spill_bytes: int
    compile_time_s: float
    cached: bool
    source_hash: str
    log: str = ""
    entries: tuple[KernelResources, ...] = ()

    def resources(self, name: str) -> KernelResources:
        """The ptxas report of entry function ``name`` (KeyError if it is not in the cubin)."""
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(name)


class CompileError(KatoError):
    """The source did not compile, or the compiled module lacks the kernel.

    ``log`` holds nvcc's output (stderr, then stdout), truncated to ``LOG_LIMIT`` characters.
    Picklable, so it can cross a process pool.
    """

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log

    def __reduce__(self) -> tuple[type[CompileError], tuple[str, str]]:
        return (type(self), (str(self), self.log))


class NvccNotFoundError(KatoError, RuntimeError):
    """No nvcc executable could be run: a problem of the machine, not of the kernel."""


class CompileJob(NamedTuple):
    """One unit of work for :func:`compile_many` (a plain 4-tuple works too)."""

    source: str
    kernel_name: str
    arch: str = "sm_90"
    options: tuple[str, ...] = ()


# --- nvcc discovery ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _nvcc_version_text(nvcc: str) -> str:
    """Full ``nvcc --version`` output (part of every cache key: it names the exact build)."""
    try:
        proc = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NvccNotFoundError(f"cannot run {nvcc!r}: {exc}") from exc
    if proc.returncode != 0:
        raise NvccNotFoundError(f"{nvcc} --version failed: {proc.stderr.strip()[:500]}")
    return proc.stdout


def nvcc_available(nvcc: str = "nvcc") -> bool:
    """True when ``nvcc`` is on PATH (or is a path) and answers ``--version``."""
    if shutil.which(nvcc) is None:
        return False
    try:
        _nvcc_version_text(nvcc)
    except NvccNotFoundError:
        return False
    return True


def cuda_version(nvcc: str = "nvcc") -> str:
    """The CUDA release of ``nvcc``, e.g. ``"13.0"``.

    Raises:
        NvccNotFoundError: nvcc cannot be run or its output has no release number.
    """
    text = _nvcc_version_text(nvcc)
    match = re.search(r"release (\d+\.\d+)", text)
    if match is None:
        raise NvccNotFoundError(f"no 'release X.Y' in {nvcc} --version output: {text[-300:]!r}")
    return match.group(1)


# --- ptxas -v parsing -------------------------------------------------------------------------

_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_FRAME_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_REGS_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """Resources of every entry function in a ``ptxas -v`` report, by (unmangled) name.

    ptxas prints, per entry function (nvcc 11 to 13)::

        ptxas info    : Compiling entry function 'softmax_kernel' for 'sm_90'
        ptxas info    : Function properties for softmax_kernel
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 30 registers, used 1 barriers, 512 bytes smem[, 372 bytes cmem[0]]

    The ``smem`` clause is absent when the kernel has no static shared memory. An entry whose
    report has no ``Used N registers`` line is left out.
    """
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in log.splitlines():
        entry = _ENTRY_RE.search(line)
        if entry is not None:
            current = sections.setdefault(entry.group(1), [])
        elif current is not None:
            current.append(line)
    found: dict[str, KernelResources] = {}
    for name, lines in sections.items():
        text = "\n".join(lines)
        regs = _REGS_RE.search(text)
        if regs is None:
            continue
        frame = _FRAME_RE.search(text)
        smem = _SMEM_RE.search(text)
        found[name] = KernelResources(
            name=name,
            registers=int(regs.group(1)),
            shared_static_bytes=int(smem.group(1)) if smem else 0,
            local_bytes=int(frame.group(1)) if frame else 0,
            spill_bytes=int(frame.group(2)) + int(frame.group(3)) if frame else 0,
        )
    return found


def _truncate(log: str) -> str:
    if len(log) <= LOG_LIMIT:
        return log
    return log[: LOG_LIMIT - 40] + f"\n... [{len(log) - LOG_LIMIT + 40} characters cut]"


# --- the cache --------------------------------------------------------------------------------


def _cache_key(
    source: str, kernel_name: str, arch: str, options: Sequence[str], nvcc_version: str
) -> str:
    payload = json.dumps(
        {
            "format": _CACHE_FORMAT,
            "source": source,
            "kernel_name": kernel_name,
            "arch": arch,
            "options": [*BASE_OPTIONS, *options],
            "nvcc": nvcc_version,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cache_load(cache_dir: Path, key: str) -> CompiledKernel | None:
    """The cached entry, or None when absent, unreadable or corrupt (then it is rebuilt)."""
    meta_path = cache_dir / f"{key}.json"
    try:
        meta = json.loads(meta_path.read_text())
        cubin = (cache_dir / f"{key}.cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest():
        return None
    try:
        return CompiledKernel(
            cubin=cubin,
            kernel_name=meta["kernel_name"],
            arch=meta["arch"],
            registers=int(meta["registers"]),
            shared_static_bytes=int(meta["shared_static_bytes"]),
            local_bytes=int(meta["local_bytes"]),
            spill_bytes=int(meta["spill_bytes"]),
            compile_time_s=float(meta["compile_time_s"]),
            cached=True,
            source_hash=key,
            log=meta.get("log", ""),
            entries=tuple(KernelResources(**entry) for entry in meta.get("entries", ())),
        )
    except (KeyError, TypeError, ValueError):
        return None


def _cache_store(cache_dir: Path, kernel: CompiledKernel) -> None:
    """Best effort: a read-only or full cache directory must not fail the compile."""
    meta = asdict(kernel)
    del meta["cubin"], meta["cached"]
    meta["cubin_sha256"] = hashlib.sha256(kernel.cubin).hexdigest()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # cubin first, metadata last: the .json is the commit marker _cache_load relies on.
        _atomic_write(cache_dir / f"{kernel.source_hash}.cubin", kernel.cubin)
        _atomic_write(cache_dir / f"{kernel.source_hash}.json", json.dumps(meta).encode())
    except OSError:
        pass


# --- compiling --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _nice_prefix(niceness: int) -> tuple[str, ...]:
    """``nice -n <niceness>`` where the ``nice`` tool exists (nvcc itself is known to run:
    its version is part of the cache key), else nothing: the compile then runs unniced."""
    nice = shutil.which("nice")
    if nice is None or niceness <= 0:
        return ()
    return (nice, "-n", str(niceness))


class _InFlight:
    """The compiles running in this process, by cache key, so that a second caller of the same
    key (the same rendered source, name, arch, options: another job's config whose template
    takes the shape at run time) waits for the first instead of running nvcc again; and a
    bound on the nvcc processes of the whole process (one per core, handed out by urgency:
    :mod:`tuner.compile_slots`), however many jobs' compile queues feed it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # The leader's want with its event: a follower raises it to its own urgency, so that a
        # measurement that waits for another job's speculative compile of the same source does
        # not wait at BULK priority behind every other job's compiles.
        self.running: dict[str, tuple[threading.Event, Want]] = {}
        self.shared = 0  # compiles answered by another caller's nvcc run (tests, benchmarks)
        self.runs = 0  # nvcc runs

    @contextlib.contextmanager
    def leader(self, key: str) -> Iterator[bool]:
        """True: this caller compiles ``key`` (others wait until the block ends); False: another
        caller did meanwhile (its result is in the cache, or it failed: compile again)."""
        want = current_want()
        with self.lock:
            running = self.running.get(key)
            if running is None:
                event = threading.Event()
                self.running[key] = (event, want)
                leads = True
            else:
                event, leader_want = running
                leads = False
        if not leads:
            leader_want.raise_to(want.urgency)  # it runs for this caller too now
            release_passed()  # the leader may be waiting for the slot this thread was handed
            event.wait()
            with self.lock:
                self.shared += 1
            yield False
            return
        try:
            yield True
        finally:
            with self.lock:
                self.running.pop(key, None)
            event.set()


_IN_FLIGHT = _InFlight()


def compile_stats() -> dict[str, int]:
    """nvcc runs in this process and compiles answered by another caller's run of the same
    source (:class:`_InFlight`)."""
    with _IN_FLIGHT.lock:
        return {"nvcc_runs": _IN_FLIGHT.runs, "shared": _IN_FLIGHT.shared}


def compile_kernel(
    source: str,
    kernel_name: str,
    arch: str = "sm_90",
    options: Sequence[str] = (),
    cache_dir: Path | None = None,
    nvcc: str = "nvcc",
    *,
    use_cache: bool = True,
    timeout_s: float = 600.0,
) -> CompiledKernel:
    """Compile ``source`` to a cubin for ``arch`` and read ``kernel_name``'s resource usage.

    Runs ``nvcc -cubin -arch=<arch> -O3 -std=c++17 -Xptxas -v <options> -o k.cubin k.cu`` in a
    temporary directory (no fast-math unless ``options`` asks for it). A cache hit returns the
    stored cubin with ``cached=True`` without running nvcc.

    Args:
        source: complete CUDA source (for a spec: ``spec.render(config, shape, dtype)``).
        kernel_name: the ``extern "C"`` kernel whose ptxas report is read.
        arch: real architecture, ``sm_XY``.
        options: extra nvcc options, e.g. ``("-DFOO=1", "-lineinfo")``.
        cache_dir: cache directory; default :func:`kato.shared.paths.compile_cache_dir`.
        nvcc: the nvcc executable.
        use_cache: False to neither read nor write the cache.
        timeout_s: nvcc is killed after this long (reported as a CompileError).

    Two callers in this process compiling the same key at once run nvcc once: the second
    waits for the first and reads its cubin from the cache.

    Raises:
        CompileError: nvcc failed or timed out, or ``kernel_name`` is not in the cubin
            (a C++-mangled name: declare the kernel ``extern "C"``).
        NvccNotFoundError: nvcc cannot be run.
    """
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise CompileError(f"arch must look like 'sm_90', got {arch!r}")
    options = tuple(options)
    key = _cache_key(source, kernel_name, arch, options, _nvcc_version_text(nvcc))
    cache_dir = Path(cache_dir) if cache_dir is not None else compile_cache_dir()
    if not use_cache:
        return _run_nvcc(source, kernel_name, arch, options, cache_dir, nvcc, key, False, timeout_s)
    hit = _cache_load(cache_dir, key)
    if hit is not None and hit.kernel_name == kernel_name and hit.arch == arch:
        return hit
    with _IN_FLIGHT.leader(key) as leads:
        if leads:
            hit = _cache_load(cache_dir, key)  # stored between the look and the lead
            if hit is not None and hit.kernel_name == kernel_name and hit.arch == arch:
                return hit
            return _run_nvcc(
                source, kernel_name, arch, options, cache_dir, nvcc, key, True, timeout_s
            )
    # Another caller compiled it: its cubin is in the cache now, unless it failed (then this
    # caller compiles it and reports the error itself) or the cache is read-only.
    hit = _cache_load(cache_dir, key)
    if hit is not None and hit.kernel_name == kernel_name and hit.arch == arch:
        return hit
    return _run_nvcc(source, kernel_name, arch, options, cache_dir, nvcc, key, True, timeout_s)


def _run_nvcc(
    source: str,
    kernel_name: str,
    arch: str,
    options: tuple[str, ...],
    cache_dir: Path,
    nvcc: str,
    key: str,
    use_cache: bool,
    timeout_s: float,
) -> CompiledKernel:
    """Run nvcc for :func:`compile_kernel` (at most one process per core at once, the most
    urgent first: this thread's :func:`~tuner.compile_slots.current_want`)."""
    with nvcc_slots().held():
        with _IN_FLIGHT.lock:
            _IN_FLIGHT.runs += 1
        return _nvcc_once(source, kernel_name, arch, options, cache_dir, nvcc, key, use_cache,
                          timeout_s)  # fmt: skip


def _nvcc_once(
    source: str,
    kernel_name: str,
    arch: str,
    options: tuple[str, ...],
    cache_dir: Path,
    nvcc: str,
    key: str,
    use_cache: bool,
    timeout_s: float,
) -> CompiledKernel:

    with tempfile.TemporaryDirectory(prefix="kato-nvcc-") as tmp:
        src = Path(tmp) / "kernel.cu"
        out = Path(tmp) / "kernel.cubin"
        src.write_text(source)
        # An absolute path: under ``nice`` a missing nvcc would be nice's exit 127, a compile
        # error of the config, instead of NvccNotFoundError, a fault of the machine.
        exe = shutil.which(nvcc)
        if exe is None:
            raise NvccNotFoundError(f"cannot run {nvcc!r}: not found")
        exe = os.path.abspath(exe)  # which() keeps a relative path; nvcc runs in ``tmp``
        cmd = [exe, "-cubin", f"-arch={arch}", *BASE_OPTIONS, *options, "-o", str(out), str(src)]
        speculative = current_want().urgency is Urgency.BULK
        cmd = [*_nice_prefix(SPECULATIVE_NICENESS if speculative else COMPILE_NICENESS), *cmd]
        start = time.perf_counter()
        try:
            # Own session: on a timeout the whole group (cicc, ptxas) is killed, not just nvcc.
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp,
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise NvccNotFoundError(f"cannot run {nvcc!r}: {exc}") from exc
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise CompileError(
                f"nvcc timed out after {timeout_s:g} s compiling {kernel_name!r} for {arch}",
                _truncate(stderr + stdout),
            ) from None
        elapsed = time.perf_counter() - start
        log = stderr + stdout
        if proc.returncode != 0 or not out.exists():
            first = next((ln for ln in log.splitlines() if "error" in ln), log.strip()[:200])
            raise CompileError(
                f"nvcc failed (exit {proc.returncode}) for {kernel_name!r} on {arch}: {first}",
                _truncate(log),
            )
        cubin = out.read_bytes()

    entries = parse_ptxas_report(log)
    resources = entries.get(kernel_name)
    if resources is None:
        raise CompileError(
            f"kernel {kernel_name!r} not found in the ptxas report for {arch}; "
            'is it declared extern "C"?',
            _truncate(log),
        )
    kernel = CompiledKernel(
        cubin=cubin,
        kernel_name=kernel_name,
        arch=arch,
        registers=resources.registers,
        shared_static_bytes=resources.shared_static_bytes,
        local_bytes=resources.local_bytes,
        spill_bytes=resources.spill_bytes,
        compile_time_s=elapsed,
        cached=False,
        source_hash=key,
        log=_truncate(log),
        entries=tuple(entries.values()),
    )
    if use_cache:
        _cache_store(cache_dir, kernel)
    return kernel


def _compile_job(
    job: CompileJob, cache_dir: Path | None, nvcc: str
) -> CompiledKernel | CompileError:
    """Worker entry point: a CompileError is returned (not raised) so the pool keeps going."""
    try:
        return compile_kernel(
            job.source, job.kernel_name, job.arch, job.options, cache_dir=cache_dir, nvcc=nvcc
        )
    except CompileError as exc:
        return exc


def compile_many(
    jobs: Sequence[CompileJob | tuple[str, str, str, Sequence[str]] | tuple[str, str, str]],
    max_workers: int | None = None,
    cache_dir: Path | None = None,
    nvcc: str = "nvcc",
    *,
    executor: concurrent.futures.Executor | None = None,
) -> list[CompiledKernel | CompileError]:
    """Compile many kernels in parallel; one result per job, in job order.

    Jobs with the same cache key (same source, name, arch, options) are compiled once and share
    the result object. Each result is a :class:`CompiledKernel` or the :class:`CompileError`
    that job raised; nothing is raised for a bad source.

    Parallelism: a job's work is an nvcc subprocess, so by default a thread pool runs them (the
    GIL is released while nvcc runs, so ``max_workers`` threads keep as many nvcc busy as
    processes would). Unlike a process pool, threads need no ``if __name__ == "__main__"``
    guard in the calling script (``spawn``/``forkserver`` re-import the main module) and are
    safe in a tuner that holds a CUDA context and other threads (``fork`` is not). Pass
    ``executor`` to use your own pool, e.g. a long-lived ``ProcessPoolExecutor`` (the job
    function, its arguments and the results all pickle); it is not shut down here.

    Args:
        jobs: :class:`CompileJob` values or ``(source, kernel_name, arch[, options])`` tuples.
        max_workers: concurrent nvcc runs when no ``executor`` is given; default
            ``os.cpu_count()``. With 1 (or one unique job) everything runs in this thread.
        cache_dir, nvcc: as for :func:`compile_kernel`.
        executor: where to run the jobs instead of a new thread pool.

    Raises:
        NvccNotFoundError: nvcc cannot be run.
    """
    normalized = [CompileJob(*job[:3], tuple(job[3]) if len(job) > 3 else ()) for job in jobs]
    version = _nvcc_version_text(nvcc)
    unique: dict[str, CompileJob] = {}
    keys: list[str] = []
    for job in normalized:
        key = _cache_key(job.source, job.kernel_name, job.arch, job.options, version)
        keys.append(key)
        unique.setdefault(key, job)

    workers = max(1, max_workers if max_workers is not None else (os.cpu_count() or 1))
    results: dict[str, CompiledKernel | CompileError] = {}
    if executor is None and (workers == 1 or len(unique) <= 1):
        for key, job in unique.items():
            results[key] = _compile_job(job, cache_dir, nvcc)
        return [results[key] for key in keys]

    own_pool = executor is None
    pool = executor or concurrent.futures.ThreadPoolExecutor(
        max_workers=min(workers, len(unique)), thread_name_prefix="kato-nvcc"
    )
    try:
        futures = {
            key: pool.submit(_compile_job, job, cache_dir, nvcc) for key, job in unique.items()
        }
        for key, future in futures.items():
            results[key] = future.result()
    finally:
        if own_pool:
            pool.shutdown(wait=True, cancel_futures=True)
    return [results[key] for key in keys]
