"""The PyCUDA backend: compiles a spec's variants with nvcc, verifies them, times them.

The only module that imports pycuda (lazily, at construction). Per config:

1. render the source and compile it with nvcc for the device's arch (``tuner.nvcc``, with an
   on-disk cache); read registers, static shared and local memory from ptxas;
2. load the cubin into the device's primary context (shared with PyTorch);
3. verify: every buffer restored to the problem as made (scratch and counters included), the
   outputs poisoned with a value the reference does not hold (NaN for floats), the call run
   twice on fresh random inputs, every element compared with the float64 reference on the
   device after each run (tolerance per dtype);
4. time: warm up, then ``repeats`` CUDA-event-timed batches of launches, each queued behind a
   spin kernel so the events time the GPU, not Python's launch rate, rotating over enough
   copies of the inputs that a batch streams twice the L2 from memory; report the per-launch
   time of each batch (the trial's time is their median). Under a per-trial limit
   (:attr:`Backend.trial_limit_s`) warm-up launches are skipped and repeats stop where the next
   would end past the trial's deadline (:class:`tuner.trial_cost.TrialDeadline`): a config whose
   one launch takes seconds is timed from fewer repeats (at least one) instead of timing out.

A failure in any step is a :class:`TrialResult` with a failure status, never an exception.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kato.kernels.limits import needs_shared_opt_in
from kato.kernels.spec import (
    CUDA_TYPES,
    DTYPES,
    Config,
    Launch,
    OperatorSpec,
    Problem,
    Step,
    TensorMap,
)
from kato.tuner import cuda_driver
from kato.tuner.backends.base import Backend, DeviceInfo, DeviceMemory, TrialResult, TrialStatus
from kato.tuner.compile_queue import CompileQueue, CompileStats
from kato.tuner.compile_slots import nvcc_slots
from kato.tuner.nvcc import CompiledKernel, CompileError, compile_kernel, cuda_version
from kato.tuner.occupancy import occupancy
from kato.tuner.space import SearchSpace
from kato.tuner.tensor_map import MAP_ALIGN, MapCache
from kato.tuner.trial_cost import TrialDeadline, launch_lower_bound_s

from kato.errors import KatoError
from kato.shared.gpus import find_gpu, normalize_gpu_name

_VERIFY_SOURCE = Path(__file__).resolve().parent.parent / "verify_kernel.cu"
_SPIN_SOURCE = Path(__file__).resolve().parent.parent / "spin_kernel.cu"
#: The ctypes type of each struct format, for launches through ``tuner.cuda_driver``.
_CTYPES = {
    "P": ctypes.c_void_p,
    "i": ctypes.c_int32,
    "I": ctypes.c_uint32,
    "q": ctypes.c_int64,
    "Q": ctypes.c_uint64,
    "f": ctypes.c_float,
    "d": ctypes.c_double,
}
_ARG_FORMATS = {
    np.int32: "i",
    np.uint32: "I",
    np.int64: "q",
    np.uint64: "Q",
    np.float32: "f",
    np.float64: "d",
}
#: Target duration of one timed batch: long enough that event resolution and launch gaps vanish.
_BATCH_TARGET_MS = 1.0
_MAX_BATCH = 200
#: Prepared kernelParams arrays kept (one per tensor-map call and buffer copy).
_MAX_DRIVER_ARGS = 4096
#: Input copies rotated while timing: a batch of up to ``_MAX_BATCH`` launches never reuses one.
_MAX_COPIES = _MAX_BATCH
#: The spin before a timed batch lasts this many times the host's measured time to queue it
#: (plus ``_SPIN_MARGIN_MS``), so the batch is queued before its start event fires.
_SPIN_FACTOR = 2.0
_SPIN_MARGIN_MS = 0.05
#: A batch whose start event fired before the host had queued it is timed again (with a spin
#: twice as long) up to this many times; the last try is kept.
_SPIN_RETRIES = 3


class ReferenceKernelError(KatoError, RuntimeError):
    """A user operator's reference kernel could not produce the references (compile error,
    launch failure, fault): no config can be verified, so the job fails with this message."""


def _import_pycuda():
    try:
        import pycuda.driver as cuda
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "the pycuda backend needs PyCUDA and a CUDA driver: pip install 'kato[cuda]'"
        ) from exc
    return cuda


def device_count() -> int:
    """Number of CUDA devices visible (0 where PyCUDA or the driver is missing)."""
    try:
        cuda = _import_pycuda()
        cuda.init()
        return cuda.Device.count()
    except Exception:
        return 0


def describe_device(index: int = 0) -> DeviceInfo:
    cuda = _import_pycuda()
    cuda.init()
    dev = cuda.Device(index)
    name = dev.name()
    return DeviceInfo(
        name=name,
        model=normalize_gpu_name(name),
        compute_capability=dev.compute_capability(),
        cuda_version=cuda_version(),
        sm_count=dev.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT),
        memory_bytes=dev.total_memory(),
    )


def timing_copies(spec: OperatorSpec, shape: Sequence[int], dtype: str, gpu: Any) -> int:
    """Input copies a backend rotates while timing, before the cap of half the free memory:
    enough that one timed batch streams more than twice the L2 from memory, counted in the
    bytes a call touches (not scratch it leaves alone)."""
    l2 = gpu.l2_bytes if gpu is not None and gpu.l2_bytes else 64 << 20
    touched = max(spec.bytes_moved(shape, dtype), 1)
    return max(1, min(_MAX_COPIES, math.ceil(2 * l2 / touched)))


def setup_bytes(spec: OperatorSpec, shape: Sequence[int], dtype: str, gpu: Any) -> int:
    """Device bytes a :class:`PyCudaBackend`'s set-up allocates at most for ``spec`` at
    ``shape``/``dtype`` on ``gpu`` (a catalog entry, or None): the argument copies it times
    over (:func:`timing_copies`), one pristine set, and the references, float32 copies of
    the outputs (at most 4 bytes per element of ``dtype`` over the arguments' bytes). An
    upper bound: the set-up may keep fewer copies where free memory is short."""
    args = spec.buffer_bytes(shape, dtype)
    itemsize = DTYPES[dtype][2] if dtype in DTYPES else 4
    references = args * max(1, 4 // itemsize)
    return (timing_copies(spec, shape, dtype, gpu) + 1) * args + references


def poison_word(dtype: np.dtype, reference: np.ndarray) -> int:
    """The bit pattern (one element of ``dtype``, as an unsigned int) that an output is filled
    with before a verification run: an element the kernel leaves unwritten must fail.

    Floating-point outputs get all bits set, a NaN, which fails every comparison. An integer
    output is compared exactly, so all bits set (-1) would pass wherever the reference holds -1
    (a sort of signed keys): it gets the first of a few patterns that ``reference`` does not
    hold (all bits set if it holds every one, which only a uint8 output of 256+ elements can)."""
    dtype = np.dtype(dtype)
    bits = 8 * dtype.itemsize
    ones = (1 << bits) - 1
    if dtype.kind not in "iu":
        return ones
    unsigned = np.dtype(f"u{dtype.itemsize}")
    present = np.unique(np.ascontiguousarray(reference, dtype=dtype).view(unsigned))
    fill = int.from_bytes(b"\x5a" * dtype.itemsize, "little")
    candidates = [ones, ones >> 1, 1 << (bits - 1), fill, *range(256)]
    for word in candidates:
        index = np.searchsorted(present, word)
        if index == present.size or present[index] != word:
            return word
    return ones


@dataclass(frozen=True)
class _Call:
    """A prepared kernel function with its launch geometry and arguments (indices into the
    problem's args, or tensor maps over one of them). A call with tensor maps holds a driver
    function (``tuner.cuda_driver``, launched with kernelParams), the others a PyCUDA one."""

    fn: Any
    launch: Launch
    args: tuple[int | TensorMap, ...]
    has_maps: bool = False


def argument_format(formats: Sequence[str], args: Sequence[int]) -> str:
    """PyCUDA's struct format of one launch's parameters (a step without tensor maps: those
    launch through ``tuner.cuda_driver``)."""
    return "".join(formats[arg] for arg in args)


def operator_space(
    spec: OperatorSpec, shape: Sequence[int], dtype: str, check: Any, gpu: Any = None
) -> SearchSpace:
    """The task's space: ``spec.params`` under ``check``, enumerated from the spec's
    :meth:`~kernels.spec.OperatorSpec.candidates` where it lists them, filtered by its
    vectorised :meth:`~kernels.spec.OperatorSpec.screen` where it has one (``check`` being
    :func:`check_on_gpu` on ``gpu``, a catalog entry or None, whose limits it applies too)."""
    screen = spec.screen(
        shape,
        dtype,
        max_threads=gpu.max_threads_per_block if gpu is not None else None,
        max_shared=gpu.shared_per_block_optin_bytes if gpu is not None else None,
    )
    if screen is not None:
        return SearchSpace(spec.params, check=check, screen=screen)
    enumerate_valid = None
    if type(spec).candidates is not OperatorSpec.candidates:

        def enumerate_valid() -> list[Config]:
            listed = spec.candidates(shape, dtype)
            if listed is None:
                return [c for c in SearchSpace(spec.params).all_configs() if check(c) is None]
            return [c for c in listed if check(c) is None]

    return SearchSpace(spec.params, check=check, enumerate_valid=enumerate_valid)


def check_on_gpu(
    spec: OperatorSpec,
    shape: Sequence[int],
    dtype: str,
    gpu: Any,
    config: dict[str, Any],
    arch: str | None = None,
) -> str | None:
    """Why ``config`` cannot run on ``gpu`` (a catalog entry, or None for an unknown model: the
    spec's constraints only) of native target ``arch`` (None: the catalog's), or None. Needs
    no GPU: the isolated backend's parent uses it."""
    reason = spec.check(config, shape, dtype)
    arch = arch or (gpu.arch if gpu is not None else None)
    if not reason and arch:
        reason = spec.check_arch(config, arch)
    if reason or gpu is None:
        return reason
    if reason := spec.check_sms(config, gpu.sm_count):
        return reason
    for step in spec.steps(config, shape, dtype):
        launch = step.launch
        if launch.threads_per_block > gpu.max_threads_per_block:
            return (
                f"{step.kernel}: {launch.threads_per_block} threads per block > "
                f"{gpu.max_threads_per_block}"
            )
        if launch.shared_bytes > gpu.shared_per_block_optin_bytes:
            return (
                f"{step.kernel}: {launch.shared_bytes} B dynamic shared memory > "
                f"{gpu.shared_per_block_optin_bytes} B per block on {gpu.name}"
            )
    return None


def compile_config(
    spec: OperatorSpec,
    shape: Sequence[int],
    dtype: str,
    config: dict[str, Any],
    arch: str,
    compile_cache: Path | None = None,
) -> CompiledKernel:
    """Render and compile one config into the on-disk cache (raises CompileError). Needs no
    GPU: the isolated backend's parent compiles ahead with it while its child measures."""
    source = spec.render(config, shape, dtype)
    target = spec.arch_for(config, arch)
    return compile_kernel(source, spec.main_kernel(config), arch=target, cache_dir=compile_cache)


def upload_constants(cuda: Any, module: Any, problem: Problem) -> None:
    """Copy a user problem's constant-memory arrays (``problem.constants``, name -> array)
    into ``module``'s ``__constant__`` globals of those names; a problem without them is left
    alone. Constant memory is per module, so this runs once per loaded module, before its
    first launch (verification, timing, a reference kernel).

    Raises:
        cuda.LogicError: the module declares no such global, or one smaller than the array
            (saying which), so the caller reports it as it reports a failed launch.
    """
    for name, values in problem.constants.items():
        try:
            pointer, size = module.get_global(name)
        except cuda.Error as exc:
            raise cuda.LogicError(
                f"constant {name}: the kernel declares no __constant__ {name} ({exc})"
            ) from None
        if size < values.nbytes:
            raise cuda.LogicError(
                f"constant {name}: __constant__ {name} holds {size} B; the spec's array is "
                f"{values.nbytes} B"
            )
        cuda.memcpy_htod(pointer, np.ascontiguousarray(values))


def verify_by_function(backend: PyCudaBackend, calls: Sequence[_Call]) -> str | None:
    """Verification by a user operator's Python verify function (Kernel Tuner's ``verify=``,
    :meth:`kernels.user.spec.UserOperatorSpec.check_results`) instead of references: every
    buffer restored to the problem as made (no poison: Kernel Tuner's verify functions read
    outputs as the kernel left them, unwritten elements included), the call run, the
    arguments it checks copied to the host and handed to the function; then a second call on
    what the first left, checked the same way. Returns why a check failed, or None."""
    cuda, spec, problem = backend.cuda, backend.spec, backend.problem
    args = backend._arg_sets[0]
    for index, arg in enumerate(problem.args):
        if isinstance(arg, np.ndarray) and arg.nbytes:
            if backend._pristine is not None:
                cuda.memcpy_dtod(args[index], backend._pristine[index], arg.nbytes)
            else:
                cuda.memcpy_htod(args[index], np.ascontiguousarray(arg))
    checked = spec.verified_arguments()
    for run in ("first", "second"):
        backend._launch(calls, args)
        cuda.Context.synchronize()
        host: list[Any] = [None] * len(problem.args)
        for index in checked:
            if isinstance(problem.args[index], np.ndarray):
                host[index] = np.empty_like(problem.args[index])
                cuda.memcpy_dtoh(host[index], args[index])
            else:
                host[index] = problem.args[index]
        error = spec.check_results(host, backend.dtype)
        if error:
            return error if run == "first" else f"{error} (on a second call)"
    return None


class PyCudaBackend(Backend):
    """Measures ``spec`` at ``shape``/``dtype`` on CUDA device ``device_index``.

    Args:
        repeats: timed batches per config (the time is their median).
        warmup: untimed launches before timing.
        seed: seeds the random inputs (each backend instance draws fresh ones).
        compile_cache: directory of the nvcc cache (None = the default).
    """

    name = "pycuda"

    def __init__(
        self,
        spec: OperatorSpec,
        shape: Sequence[int],
        dtype: str,
        *,
        device_index: int = 0,
        repeats: int = 15,
        warmup: int = 3,
        seed: int | None = None,
        compile_cache: Path | None = None,
        defer_setup: bool = False,
    ):
        """``defer_setup``: leave the problem's inputs, float64 references and device buffers
        (seconds for a large shape) to :meth:`prepare`, which the first :meth:`evaluate` calls;
        a worker builds the backend, starts compiling the job's configs, then measures, so the
        setup runs while nvcc does. Else they are made here."""
        self.cuda = cuda = _import_pycuda()
        cuda.init()
        self.spec, self.shape, self.dtype = spec, tuple(shape), dtype
        self.repeats, self.warmup = repeats, warmup
        self.compile_cache = compile_cache
        self._device = cuda.Device(device_index)
        self._context = self._device.retain_primary_context()
        self._context.push()
        self.info = describe_device(device_index)
        self.gpu = find_gpu(self.info.model)
        self._rng = np.random.default_rng(seed)
        self._modules: list[Any] = []  # keep loaded modules alive
        # Modules loaded through the driver for tensor-map steps: unloaded at close, since the
        # primary context (and whatever a module's globals hold) outlives this backend.
        self._driver_modules: list[Any] = []
        # Tensor maps per (declaration, buffer): 2 x 200 input copies stay encoded.
        self._maps = MapCache(capacity=4 * _MAX_COPIES)
        self._driver_args: dict[tuple[int, int], tuple[_Call, Any, list[Any], list[Any]]] = {}
        self._space: SearchSpace | None = None
        self._queue: CompileQueue[CompiledKernel] | None = None
        self._prepared = False
        self._made: Problem | None = None  # the problem's host arrays (prepare_inputs)
        if not defer_setup:
            self.prepare()

    def prepare_inputs(self) -> None:
        """The host part of :meth:`prepare`: the problem's random inputs and float64
        references (seconds of CPU for a large shape, no GPU work), so that they can be made
        while another job has the GPU (once; idempotent)."""
        if self._made is None:
            self._made = self.spec.make_problem(self.shape, self.dtype, self._rng)

    def prepare(self) -> None:
        """Make the inputs, references, device buffers, verifier and spin kernel (once;
        idempotent)."""
        if self._prepared:
            return
        self._setup_buffers()
        self._verifiers = self._load_verifier()
        self._spin = self._load_helper(_SPIN_SOURCE, "spin_ns", (), "Q")
        self._prepared = True

    # --- setup ------------------------------------------------------------------------------

    def _setup_buffers(self) -> None:
        cuda = self.cuda
        self.prepare_inputs()
        problem = self._made
        assert problem is not None
        self.problem = problem
        # A user operator may take its references from a reference kernel, run here once.
        reference = self.spec.device_reference(self.shape, self.dtype)
        if reference is not None:
            problem.references = self.run_reference(problem, reference)
        self._arg_formats = [
            "P" if isinstance(a, np.ndarray) else _ARG_FORMATS[type(a)] for a in problem.args
        ]
        copies = timing_copies(self.spec, self.shape, self.dtype, self.gpu)
        free, _ = cuda.mem_get_info()
        fit = int(0.5 * free // max(problem.nbytes, 1))
        # One more set where it fits: the pristine buffers every verification starts from (a
        # device copy takes microseconds; from the host, tens of ms per config).
        keep_pristine = fit >= 2
        copies = max(1, min(copies, fit - int(keep_pristine)))
        self._arg_sets: list[list[Any]] = []
        for _ in range(copies + int(keep_pristine)):
            args = []
            for a in problem.args:
                if isinstance(a, np.ndarray):
                    buf = cuda.mem_alloc(max(a.nbytes, 1))
                    cuda.memcpy_htod(buf, np.ascontiguousarray(a))
                    args.append(buf)
                else:
                    args.append(a)
            self._arg_sets.append(args)
        self._pristine = self._arg_sets.pop() if keep_pristine else None
        self._next_set = 0  # the copy the next timed launch reads: rotation runs across repeats
        # References on the device: float32 copies of the float64 references for floating-point
        # outputs, the output's own integer type for integer outputs (compared exactly).
        self._refs = []
        self._poisons = []
        for out_index, ref in zip(problem.outputs, problem.references, strict=True):
            out_dtype = problem.args[out_index].dtype
            ref_dtype = out_dtype if out_dtype.kind in "iu" else np.dtype(np.float32)
            host = np.ascontiguousarray(ref, dtype=ref_dtype)
            buf = cuda.mem_alloc(max(host.nbytes, 4))
            cuda.memcpy_htod(buf, host)
            self._refs.append((out_index, buf, ref.size))
            self._poisons.append(poison_word(out_dtype, host))
        self._bad = cuda.mem_alloc(8)
        self._max_err = cuda.mem_alloc(4)

    def run_reference(self, problem: Problem, reference: Any) -> list[np.ndarray]:
        """Run a reference kernel (a :class:`kernels.user.spec.DeviceReference`: source, entry
        point, launch; it takes every problem argument in order) once on a copy of the problem
        and return its outputs (``problem.outputs``) as float64: what every variant must match.

        Raises:
            ReferenceKernelError: it does not compile, does not launch or faults (saying
                which); the job fails with that message, since no variant can be checked.
        """
        cuda = self.cuda
        what = f"reference kernel {reference.kernel_name}"
        try:
            compiled = compile_kernel(
                reference.source, reference.kernel_name, arch=self.info.arch,
                cache_dir=self.compile_cache,
            )  # fmt: skip
        except CompileError as exc:
            raise ReferenceKernelError(f"{what} does not compile: {exc.log[-2000:]}") from None
        buffers: list[Any] = []
        try:
            module = cuda.module_from_buffer(compiled.cubin)
            self._modules.append(module)
            upload_constants(cuda, module, problem)
            fn = module.get_function(reference.kernel_name)
            args = []
            for a in problem.args:
                if isinstance(a, np.ndarray):
                    buf = cuda.mem_alloc(max(a.nbytes, 1))
                    cuda.memcpy_htod(buf, np.ascontiguousarray(a))
                    buffers.append(buf)
                    args.append(buf)
                else:
                    args.append(a)
            fn.prepare("".join(
                "P" if isinstance(a, np.ndarray) else _ARG_FORMATS[type(a)] for a in problem.args
            ))  # fmt: skip
            launch = reference.launch
            fn.prepared_call(launch.grid, launch.block, *args, shared_size=launch.shared_bytes)
            cuda.Context.synchronize()
            references = []
            for index in problem.outputs:
                host = np.empty_like(problem.args[index])
                cuda.memcpy_dtoh(host, args[index])
                references.append(host.astype(np.float64))
        except cuda.Error as exc:
            raise ReferenceKernelError(f"{what} failed: {type(exc).__name__}: {exc}") from None
        finally:
            for buf in buffers:  # a dead context frees nothing; its process is replaced
                with contextlib.suppress(cuda.Error):
                    buf.free()
        return references

    def _load_verifier(self) -> dict[np.dtype, Any]:
        """One ``count_mismatches`` function per distinct output dtype."""
        functions: dict[np.dtype, Any] = {}
        for out_index in self.problem.outputs:
            out_dtype = self.problem.args[out_index].dtype
            if out_dtype in functions:
                continue
            ctype = CUDA_TYPES[out_dtype]
            is_int = out_dtype.kind in "iu"
            options = [f"-DOUT_T={ctype}", f"-DREF_T={ctype if is_int else 'float'}"]
            options.append(f"-DOUT_IS_INT={int(is_int)}")
            functions[out_dtype] = self._load_helper(
                _VERIFY_SOURCE, "count_mismatches", tuple(options), "PPqffPP"
            )
        return functions

    def _load_helper(
        self, source: Path, name: str, options: tuple[str, ...], arg_format: str
    ) -> Any:
        """Compile (through the nvcc cache), load and prepare one of the backend's own kernels.
        ``options`` is an argv list: "-DOUT_T=unsigned int" is one argument."""
        compiled = compile_kernel(
            source.read_text(), name, arch=self.info.arch, options=options,
            cache_dir=self.compile_cache,
        )  # fmt: skip
        module = self.cuda.module_from_buffer(compiled.cubin)
        self._modules.append(module)
        fn = module.get_function(name)
        fn.prepare(arg_format)
        return fn

    # --- Backend API ------------------------------------------------------------------------

    def device(self) -> DeviceInfo:
        return self.info

    def space(self) -> SearchSpace:
        if self._space is None:  # one instance, so its valid-config list is computed once
            self._space = operator_space(self.spec, self.shape, self.dtype, self.check, self.gpu)
        return self._space

    def check(self, config: dict[str, Any]) -> str | None:
        """The spec's constraints plus this device's arch and limits (threads, shared memory)."""
        return check_on_gpu(self.spec, self.shape, self.dtype, self.gpu, config, self.info.arch)

    def _compile_now(self, config: dict[str, Any]) -> CompiledKernel:
        return compile_config(
            self.spec, self.shape, self.dtype, config, self.info.arch, self.compile_cache
        )

    @property
    def compile_stats(self) -> CompileStats:
        """Compiles taken ahead / inline, and seconds measuring waited on them."""
        return self._queue.stats if self._queue is not None else CompileStats()

    def _compile_queue(self, max_workers: int | None = None) -> CompileQueue[CompiledKernel]:
        if self._queue is None:
            self._queue = CompileQueue(
                self._compile_now, self.space().key, max_workers, nvcc_slots()
            )
        return self._queue

    def compile(self, config: dict[str, Any]) -> CompiledKernel:
        """Render and compile ``config`` (raises CompileError); waits for a compile started
        ahead by :meth:`precompile` or :meth:`hint` instead of starting a second one, and
        compiles now one that has not started (it does not queue behind the others)."""
        return self._compile_queue().take(config)

    def precompile(self, configs: Sequence[dict[str, Any]], max_workers: int | None = None) -> None:
        """Queue ``configs`` for compiling in the background (nvcc processes run in parallel,
        one per core less one by default), in order, behind any hinted ones. Results land in the
        on-disk cache too; :meth:`compile` picks them up."""
        self._compile_queue(max_workers).add(configs)

    def hint(self, configs: Sequence[dict[str, Any]]) -> None:
        """Compile ``configs`` next, before the rest of the queue: the search expects to ask
        for them soon (``Search(on_upcoming=...)``)."""
        self._compile_queue().hint(configs)

    def is_compiled(self, config: dict[str, Any]) -> bool:
        """Whether measuring ``config`` now would not wait on nvcc (its compile ahead is done);
        a search asks for other configs meanwhile (``Search(ready=...)``)."""
        return self._queue is not None and self._queue.is_done(config)

    def wait_compiled(self, configs: Sequence[dict[str, Any]]) -> None:
        """Block until one of ``configs`` has finished compiling ahead (at once if none of them
        has started): the search then measures that one (``Search(wait_ready=...)``)."""
        if self._queue is not None:
            self._queue.wait_any(configs)

    def launch_lower_bound_s(self) -> float | None:
        return launch_lower_bound_s(self.spec, self.shape, self.dtype, self.gpu)

    def evaluate(self, config: dict[str, Any]) -> TrialResult:
        self.prepare()  # once per backend: outside the trial's limit, as in a measuring child
        deadline = TrialDeadline(self.trial_limit_s)  # the trial's compile counts against it
        result = TrialResult(config=dict(config), status=TrialStatus.OK)
        reason = self.check(config)
        if reason:
            result.status, result.error = TrialStatus.INVALID, reason
            return result
        t0 = time.perf_counter()
        try:
            compiled = self.compile(config)
        except CompileError as exc:
            result.status, result.error = TrialStatus.COMPILE_ERROR, exc.log[-4000:]
            result.compile_time_s = time.perf_counter() - t0
            return result
        launch = self.spec.launch(config, self.shape, self.dtype)
        result.compile_time_s = compiled.compile_time_s
        shared = compiled.shared_static_bytes + launch.shared_bytes
        if self.gpu is not None and shared > self.gpu.shared_per_block_optin_bytes:
            # Only now known: the static part is what ptxas reported for this config.
            result.status = TrialStatus.INVALID
            result.error = (
                f"{self.spec.main_kernel(config)}: {compiled.shared_static_bytes} B static + "
                f"{launch.shared_bytes} B dynamic shared memory > "
                f"{self.gpu.shared_per_block_optin_bytes} B per block on {self.gpu.name}"
            )
            return result
        result.registers = compiled.registers
        result.shared_static_bytes = compiled.shared_static_bytes
        result.shared_dynamic_bytes = launch.shared_bytes
        result.local_bytes = compiled.local_bytes
        if self.gpu is not None:
            occ = occupancy(
                self.gpu,
                launch.threads_per_block,
                compiled.registers,
                compiled.shared_static_bytes + launch.shared_bytes,
            )
            result.blocks_per_sm, result.occupancy = occ.blocks_per_sm, occ.fraction
        try:
            calls = self.load(compiled, self.spec.steps(config, self.shape, self.dtype))
            t_verify = time.perf_counter()
            error = self.verify(calls)
            verify_s = time.perf_counter() - t_verify
        except (self.cuda.Error, cuda_driver.CudaDriverError) as exc:  # PyCUDA or ctypes launch
            result.status, result.error = TrialStatus.LAUNCH_ERROR, f"{type(exc).__name__}: {exc}"
            return result
        if error:
            result.status, result.error = TrialStatus.VERIFY_ERROR, error
            return result
        try:
            result.times_ms = self.time(calls, deadline, launch_s=verify_s / 2)
        except (self.cuda.Error, cuda_driver.CudaDriverError) as exc:
            result.status, result.error = TrialStatus.LAUNCH_ERROR, f"{type(exc).__name__}: {exc}"
        return result

    # --- steps ------------------------------------------------------------------------------

    def load(self, compiled: CompiledKernel, steps: Sequence[Step]) -> list[_Call]:
        """Load the cubin and prepare one call per step (functions fetched once per kernel)."""
        module = None
        functions: dict[str, Any] = {}
        formats: dict[str, str] = {}  # the argument format each of ``functions`` is prepared for
        driver_module = None
        calls = []
        for step in steps:
            indices = step.args if step.args is not None else tuple(range(len(self.problem.args)))
            if any(isinstance(i, TensorMap) for i in indices):
                # PyCUDA's packed argument buffer does not carry a by-value tensor map intact
                # (see tuner.cuda_driver): such steps launch through the driver's kernelParams.
                if self.problem.constants:  # they are uploaded into the PyCUDA module only
                    raise cuda_driver.CudaDriverError(
                        f"{step.kernel}: a step with tensor maps cannot take __constant__ arrays"
                    )
                if driver_module is None:
                    driver_module = cuda_driver.load_module(compiled.cubin)
                    self._driver_modules.append(driver_module)
                fn = cuda_driver.get_function(driver_module, step.kernel, step.launch.shared_bytes)
                calls.append(_Call(fn, step.launch, indices, has_maps=True))
                continue
            if module is None:
                # Loaded only for steps PyCUDA launches: a tensor-map kernel's module would
                # otherwise sit in the context twice (a stream-K workspace is 17 MB a copy).
                module = self.cuda.module_from_buffer(compiled.cubin)
                self._modules.append(module)
                upload_constants(self.cuda, module, self.problem)
            fn = functions.get(step.kernel)
            if fn is None:
                fn = functions[step.kernel] = module.get_function(step.kernel)
            dynamic = step.launch.shared_bytes
            static = fn.get_attribute(self.cuda.function_attribute.SHARED_SIZE_BYTES)
            if needs_shared_opt_in(static, dynamic):
                fn.set_attribute(
                    self.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic
                )
            # A prepared function keeps one argument format: a kernel used by two steps with
            # different argument lists gets a second function object.
            fmt = argument_format(self._arg_formats, indices)
            if formats.setdefault(step.kernel, fmt) != fmt:
                fn = module.get_function(step.kernel)
            fn.prepare(fmt)
            calls.append(_Call(fn, step.launch, indices))
        return calls

    def _launch(self, calls: Sequence[_Call], args: list[Any]) -> None:
        for call in calls:
            launch = call.launch
            if call.has_maps:
                cuda_driver.launch_array(
                    call.fn, launch.grid, launch.block, launch.shared_bytes, 0,
                    self._driver_arguments(call, args),
                )  # fmt: skip
                continue
            values = [args[i] for i in call.args]
            call.fn.prepared_call(
                launch.grid, launch.block, *values, shared_size=launch.shared_bytes
            )

    def _driver_arguments(self, call: _Call, args: list[Any]) -> Any:
        """The kernelParams array of a tensor-map call on one copy of the buffers, built once
        per (call, copy): maps encoded over that copy's buffers, the rest as ctypes values."""
        key = (id(call), id(args))
        found = self._driver_args.get(key)
        if found is not None and found[0] is call and found[3] is args:
            return found[1]
        if len(self._driver_args) > _MAX_DRIVER_ARGS:  # calls of configs measured before
            self._driver_args.clear()
        values: list[Any] = []
        for i in call.args:
            if isinstance(i, TensorMap):
                encoded = self._maps.get(i, int(args[i.array]))
                values.append(cuda_driver.aligned_bytes(encoded, MAP_ALIGN))
            else:
                values.append(_CTYPES[self._arg_formats[i]](int(args[i]) if self._arg_formats[i]
                              in "PiIqQ" else float(args[i])))  # fmt: skip
        params = cuda_driver.argument_array(values)
        # The ctypes values must outlive the launches that read them; the call and the buffers
        # are kept to tell a reused id from the same object.
        self._driver_args[key] = (call, params, values, args)
        return params

    def verify(self, calls: Sequence[_Call]) -> str | None:
        """Run the call on the reference inputs and return an error text if any output element is
        outside tolerance (None if all match).

        Every buffer starts as :meth:`OperatorSpec.make_problem` made it (inputs, NaN-filled
        scratch, zeroed counters: a previous config's run leaves nothing behind) and the outputs
        are poisoned with a value the reference does not hold. The call then runs twice, the
        outputs poisoned again before the second run and compared after each: the first catches
        an element left unwritten, the second a kernel that does not leave its scratch (a
        counter, a mask) ready for the next call, as every timed launch after it relies on."""
        if self.spec.verify_function is not None:
            return verify_by_function(self, calls)
        cuda = self.cuda
        args = self._arg_sets[0]
        for index, arg in enumerate(self.problem.args):
            if not isinstance(arg, np.ndarray) or not arg.nbytes:
                continue
            if self._pristine is not None:
                cuda.memcpy_dtod(args[index], self._pristine[index], arg.nbytes)
            else:
                cuda.memcpy_htod(args[index], np.ascontiguousarray(arg))
        for run in ("first", "second"):
            self._poison_outputs(args)
            self._launch(calls, args)
            cuda.Context.synchronize()
            error = self._compare(args)
            if error:
                return error if run == "first" else f"{error} (on a second call)"
        return None

    def _poison_outputs(self, args: list[Any]) -> None:
        memsets = {4: self.cuda.memset_d32, 2: self.cuda.memset_d16, 1: self.cuda.memset_d8}
        for (out_index, _, _), word in zip(self._refs, self._poisons, strict=True):
            out = self.problem.args[out_index]
            if out.itemsize in memsets:
                memsets[out.itemsize](args[out_index], word, out.size)
            else:  # 8-byte elements: no memset of that width
                fill = np.full(out.size, word, dtype=f"u{out.itemsize}")
                self.cuda.memcpy_htod(args[out_index], fill)

    def _compare(self, args: list[Any]) -> str | None:
        """Compare every output of ``args`` with its reference on the device."""
        cuda = self.cuda
        tolerances = self.problem.tolerances or [self.spec.tolerance(self.dtype)] * len(self._refs)
        for (out_index, ref_buf, n), (atol, rtol) in zip(self._refs, tolerances, strict=True):
            cuda.memset_d8(self._bad, 0, 8)
            cuda.memset_d8(self._max_err, 0, 4)
            grid = (min(4096, max(1, (n + 255) // 256)), 1, 1)
            self._verifiers[self.problem.args[out_index].dtype].prepared_call(
                grid,
                (256, 1, 1),
                args[out_index],
                ref_buf,
                np.int64(n),
                np.float32(atol),
                np.float32(rtol),
                self._bad,
                self._max_err,
            )
            bad = np.zeros(1, np.uint64)
            max_err = np.zeros(1, np.float32)
            cuda.memcpy_dtoh(bad, self._bad)
            cuda.memcpy_dtoh(max_err, self._max_err)
            if bad[0]:
                return (
                    f"output {out_index}: {int(bad[0])} of {n} elements outside tolerance "
                    f"(atol={atol}, rtol={rtol}); max abs error {float(max_err[0]):.3g}"
                )
        return None

    def time(
        self,
        calls: Sequence[_Call],
        deadline: TrialDeadline | None = None,
        *,
        launch_s: float = 0.0,
    ) -> list[float]:
        """Per-call milliseconds (all steps) of each of ``repeats`` batches (after warm-up).

        A batch is ``ceil(1 ms / one call)`` calls (at most ``_MAX_BATCH``) between two events,
        rotating over the input copies. Each batch is queued behind a spin kernel that holds the
        GPU for twice the host's time to queue the batch, so the events time the GPU running the
        calls back to back, not Python launching them (a 3 us kernel reads ~9 us otherwise).

        With a ``deadline``, warm-up launches (each guessed to take ``launch_s``, what a
        verification run took) are run only while they and two more launches fit before it,
        and a batch after the first only where its cost (the previous batch's) fits: fewer
        repeats, never none."""
        cuda = self.cuda
        deadline = deadline or TrialDeadline(None)
        warmup = self.warmup
        while warmup and not deadline.allows((warmup + 2) * launch_s):
            warmup -= 1
        for _ in range(warmup):
            self._launch(calls, self._next_args())
        start, end = cuda.Event(), cuda.Event()
        t0 = time.perf_counter()
        start.record()
        self._launch(calls, self._next_args())
        end.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        end.synchronize()
        single = max(end.time_since(start), 1e-3)
        batch = max(1, min(_MAX_BATCH, math.ceil(_BATCH_TARGET_MS / single)))
        spin_ms = _SPIN_FACTOR * batch * host_ms + _SPIN_MARGIN_MS
        times: list[float] = []
        batch_s = 0.0  # wall seconds the last batch took, spin included
        for _ in range(self.repeats):
            if times and not deadline.allows(batch_s):
                break  # the next batch would end past the trial's deadline
            t_batch = time.perf_counter()
            for _ in range(_SPIN_RETRIES):
                self._spin.prepared_call((1, 1, 1), (1, 1, 1), np.uint64(spin_ms * 1e6))
                start.record()
                t0 = time.perf_counter()
                for _ in range(batch):
                    self._launch(calls, self._next_args())
                queued_ms = (time.perf_counter() - t0) * 1e3
                end.record()
                overtaken = start.query()  # the GPU began the batch before it was all queued
                end.synchronize()
                if not overtaken:
                    break
                spin_ms = max(2 * spin_ms, _SPIN_FACTOR * queued_ms)
            times.append(end.time_since(start) / batch)
            batch_s = time.perf_counter() - t_batch
        return times

    def _next_args(self) -> list[Any]:
        args = self._arg_sets[self._next_set % len(self._arg_sets)]
        self._next_set += 1
        return args

    def healthy(self) -> bool:
        """Probe the context: after a sticky fault (illegal address, trap) every CUDA call fails,
        so a tiny memset + synchronize tells a dead context from a config-specific failure."""
        if not self._prepared:
            return True  # nothing has run on the device yet
        try:
            self.cuda.memset_d8(self._bad, 0, 8)
            self.cuda.Context.synchronize()
        except self.cuda.Error:
            return False
        return True

    def memory(self) -> DeviceMemory:
        """The device's free and total memory now (``cuMemGetInfo``, in this backend's
        context: :class:`tuner.backends.abilities.ReportsMemory`)."""
        free, total = self.cuda.mem_get_info()
        return DeviceMemory(free_bytes=int(free), total_bytes=int(total))

    def close_compiles(self) -> None:
        """Drop the compiles queued ahead and wait for the running ones (no GPU work)."""
        if self._queue is not None:
            self._queue.close()

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()  # its stats stay readable
        if self._context is not None:
            self._modules.clear()
            for module in self._driver_modules:
                # A context a kernel fault destroyed has no modules left to unload.
                with contextlib.suppress(cuda_driver.CudaDriverError):
                    cuda_driver.unload_module(module)
            self._driver_modules.clear()
            self._context.pop()
            self._context.detach()
            self._context = None
