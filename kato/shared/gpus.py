"""The GPU catalog: the models Kato knows, their per-SM limits and their headline figures.

A result is keyed by a GPU *model*, the catalog's canonical name ("H200", "A100 80GB"), not by
whatever string a driver or a user hands in: :func:`normalize_gpu_name` maps the driver's names
("NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-32GB") and common spellings to it, and returns other
names cleaned (vendor prefix dropped) so that results from unlisted GPUs can still be stored.

Per-SM limits follow the CUDA C++ Programming Guide, "Technical Specifications per Compute
Capability", and the toolkit's ``cuda_occupancy.h`` (allocation granularities, shared-memory
carveouts); they are the same for every GPU of one compute capability, so they live in one
table per capability (:data:`_ARCH_LIMITS`) rather than once per GPU. Shared-memory figures are
the ones ``cudaGetDeviceProperties`` reports: ``shared_per_sm_bytes`` is
``sharedMemPerMultiprocessor`` (the largest carveout), ``shared_per_block_optin_bytes`` is
``sharedMemPerBlockOptin`` (that minus the 1 KiB the driver reserves per block on cc >= 8.0).

Headline figures (memory, bandwidth, L2, clock) are the vendor's for the named board; they are
informational (rooflines, input sizing), not used by the occupancy calculator.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from kato.errors import InvalidInput

KIB = 1024
MIB = 1024 * KIB
GB = 10**9


class UnknownGpu(InvalidInput):
    """A GPU model the catalog does not list (the message names the ones it does)."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: identity, per-SM resource limits, and headline figures.

    Limits are per streaming multiprocessor (SM) unless the name says per block or per thread.
    """

    name: str  # canonical model name, the key results are stored under ("H200")
    full_name: str  # what the driver reports ("NVIDIA H200")
    aliases: tuple[str, ...]  # other names it answers to (matched case/space/dash-insensitively)
    compute_capability: tuple[int, int]
    sm_count: int
    # threads, warps and blocks
    max_threads_per_sm: int
    max_threads_per_block: int
    max_blocks_per_sm: int
    warp_size: int
    # registers (32-bit)
    registers_per_sm: int
    max_registers_per_block: int
    max_registers_per_thread: int
    register_alloc_unit: int  # registers are allocated per warp, in units of this many
    warp_alloc_granularity: int  # SM sub-partitions; a block's warps are rounded up to this
    # shared memory (bytes)
    shared_per_sm_bytes: int  # largest configurable carveout (sharedMemPerMultiprocessor)
    shared_per_block_bytes: int  # static limit, and dynamic without opt-in (48 KiB)
    shared_per_block_optin_bytes: int  # per-block maximum after cuFuncSetAttribute opt-in
    shared_alloc_unit_bytes: int  # a block's shared memory is rounded up to this
    shared_reserved_per_block_bytes: int  # taken by the driver from every block (cc >= 8.0)
    shared_carveouts_kib: tuple[int, ...]  # the per-SM shared sizes the hardware can be set to
    # headline figures
    l2_bytes: int
    memory_bytes: int  # nominal capacity (GB = 10**9 bytes); the driver reports about this
    memory_bandwidth_gbs: float  # nominal peak, GB/s
    clock_mhz: int | None = None  # boost clock of the SMs

    @property
    def arch(self) -> str:
        """The nvcc target for this GPU's native code ("sm_90")."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view for the API: every field, lists for tuples, plus the derived ones."""
        d = asdict(self)
        d["aliases"] = list(self.aliases)
        d["compute_capability"] = list(self.compute_capability)
        d["shared_carveouts_kib"] = list(self.shared_carveouts_kib)
        d["arch"] = self.arch
        d["max_warps_per_sm"] = self.max_warps_per_sm
        return d


# Per compute capability: the CUDA C++ Programming Guide's "Technical Specifications per Compute
# Capability" table, plus the granularities and carveout sizes of cuda_occupancy.h
# (cudaOccSMemAllocationGranularity, cudaOccSubPartitionsPerMultiprocessor,
# cudaOccAlignUpShmemSizeVoltaPlus). Turing (7.5) cannot configure less than 32 KiB of shared
# memory, hence no 0 in its carveouts.
_COMMON_LIMITS: dict[str, int] = {
    "max_threads_per_block": 1024,
    "warp_size": 32,
    "registers_per_sm": 64 * KIB,
    "max_registers_per_block": 64 * KIB,
    "max_registers_per_thread": 255,
    "register_alloc_unit": 256,
    "warp_alloc_granularity": 4,
    "shared_per_block_bytes": 48 * KIB,
}

_ARCH_LIMITS: dict[tuple[int, int], dict[str, Any]] = {
    (7, 0): {  # Volta: V100
        "max_threads_per_sm": 2048,
        "max_blocks_per_sm": 32,
        "shared_per_sm_bytes": 96 * KIB,
        "shared_per_block_optin_bytes": 96 * KIB,
        "shared_alloc_unit_bytes": 256,
        "shared_reserved_per_block_bytes": 0,
        "shared_carveouts_kib": (0, 8, 16, 32, 64, 96),
    },
    (7, 5): {  # Turing: T4, RTX 20xx
        "max_threads_per_sm": 1024,
        "max_blocks_per_sm": 16,
        "shared_per_sm_bytes": 64 * KIB,
        "shared_per_block_optin_bytes": 64 * KIB,
        "shared_alloc_unit_bytes": 256,
        "shared_reserved_per_block_bytes": 0,
        "shared_carveouts_kib": (32, 64),
    },
    (8, 0): {  # Ampere GA100: A100
        "max_threads_per_sm": 2048,
        "max_blocks_per_sm": 32,
        "shared_per_sm_bytes": 164 * KIB,
        "shared_per_block_optin_bytes": 163 * KIB,
        "shared_alloc_unit_bytes": 128,
        "shared_reserved_per_block_bytes": 1 * KIB,
        "shared_carveouts_kib": (0, 8, 16, 32, 64, 100, 132, 164),
    },
    (8, 6): {  # Ampere GA10x: RTX 30xx, RTX A-series
        "max_threads_per_sm": 1536,
        "max_blocks_per_sm": 16,
        "shared_per_sm_bytes": 100 * KIB,
        "shared_per_block_optin_bytes": 99 * KIB,
        "shared_alloc_unit_bytes": 128,
        "shared_reserved_per_block_bytes": 1 * KIB,
        "shared_carveouts_kib": (0, 8, 16, 32, 64, 100),
    },
    (8, 9): {  # Ada: L4, L40S, RTX 40xx
        "max_threads_per_sm": 1536,
        "max_blocks_per_sm": 24,
        "shared_per_sm_bytes": 100 * KIB,
        "shared_per_block_optin_bytes": 99 * KIB,
        "shared_alloc_unit_bytes": 128,
        "shared_reserved_per_block_bytes": 1 * KIB,
        "shared_carveouts_kib": (0, 8, 16, 32, 64, 100),
    },
    (9, 0): {  # Hopper: H100, H200
        "max_threads_per_sm": 2048,
        "max_blocks_per_sm": 32,
        "shared_per_sm_bytes": 228 * KIB,
        "shared_per_block_optin_bytes": 227 * KIB,
        "shared_alloc_unit_bytes": 128,
        "shared_reserved_per_block_bytes": 1 * KIB,
        "shared_carveouts_kib": (0, 8, 16, 32, 64, 100, 132, 164, 196, 228),
    },
}


def known_compute_capabilities() -> list[tuple[int, int]]:
    """Compute capabilities whose per-SM limits the catalog knows."""
    return sorted(_ARCH_LIMITS)


def spec_for_compute_capability(
    name: str,
    compute_capability: tuple[int, int],
    sm_count: int,
    *,
    full_name: str | None = None,
    aliases: tuple[str, ...] = (),
    l2_bytes: int = 0,
    memory_bytes: int = 0,
    memory_bandwidth_gbs: float = 0.0,
    clock_mhz: int | None = None,
) -> GpuSpec:
    """A :class:`GpuSpec` with the per-SM limits of ``compute_capability``.

    Builds the catalog, and lets a backend describe an unlisted GPU of a known architecture
    (from device attributes) so that occupancy can still be computed for it.

    Raises:
        InvalidInput: the compute capability is not in :func:`known_compute_capabilities`.
    """
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    if cc not in _ARCH_LIMITS:
        known = ", ".join(f"{a}.{b}" for a, b in known_compute_capabilities())
        raise InvalidInput(
            f"no per-SM limits for compute capability {cc[0]}.{cc[1]} (known: {known})"
        )
    return GpuSpec(
        name=name,
        full_name=full_name or name,
        aliases=aliases,
        compute_capability=cc,
        sm_count=sm_count,
        l2_bytes=l2_bytes,
        memory_bytes=memory_bytes,
        memory_bandwidth_gbs=memory_bandwidth_gbs,
        clock_mhz=clock_mhz,
        **_COMMON_LIMITS,
        **_ARCH_LIMITS[cc],
    )


# The catalog. Headline figures are the vendor's datasheet values for the named board (SXM where
# a model comes in several), except H200's L2, which is what the device reported on the machine
# (60 MiB; NVIDIA's datasheets give 50 MB for the GH100 boards).
_CATALOG: tuple[GpuSpec, ...] = (
    spec_for_compute_capability(
        "H200", (9, 0), 132, full_name="NVIDIA H200",
        aliases=("H200 SXM", "H200 SXM5", "H200-SXM5-141GB", "H200 141GB HBM3e"),
        l2_bytes=60 * MIB, memory_bytes=141 * GB, memory_bandwidth_gbs=4800, clock_mhz=1980,
    ),
    spec_for_compute_capability(
        "H100 SXM", (9, 0), 132, full_name="NVIDIA H100 80GB HBM3",
        aliases=("H100", "H100 SXM5", "H100-SXM5-80GB", "H100 80GB HBM3", "H100 SXM5 80GB"),
        l2_bytes=50 * MIB, memory_bytes=80 * GB, memory_bandwidth_gbs=3350, clock_mhz=1980,
    ),
    spec_for_compute_capability(
        "H100 PCIe", (9, 0), 114, full_name="NVIDIA H100 PCIe",
        aliases=("H100-PCIE-80GB", "H100 PCIe 80GB"),
        l2_bytes=50 * MIB, memory_bytes=80 * GB, memory_bandwidth_gbs=2000, clock_mhz=1755,
    ),
    spec_for_compute_capability(
        "A100 80GB", (8, 0), 108, full_name="NVIDIA A100-SXM4-80GB",
        aliases=("A100-SXM4-80GB", "A100-SXM-80GB", "A100 SXM4 80GB", "A100 SXM 80GB"),
        l2_bytes=40 * MIB, memory_bytes=80 * GB, memory_bandwidth_gbs=2039, clock_mhz=1410,
    ),
    spec_for_compute_capability(
        "A100 40GB", (8, 0), 108, full_name="NVIDIA A100-PCIE-40GB",
        aliases=("A100-PCIE-40GB", "A100 PCIe 40GB", "A100 40GB PCIe"),
        l2_bytes=40 * MIB, memory_bytes=40 * GB, memory_bandwidth_gbs=1555, clock_mhz=1410,
    ),
    spec_for_compute_capability(
        "L40S", (8, 9), 142, full_name="NVIDIA L40S",
        l2_bytes=96 * MIB, memory_bytes=48 * GB, memory_bandwidth_gbs=864, clock_mhz=2520,
    ),
    spec_for_compute_capability(
        "L4", (8, 9), 58, full_name="NVIDIA L4",
        l2_bytes=48 * MIB, memory_bytes=24 * GB, memory_bandwidth_gbs=300, clock_mhz=2040,
    ),
    spec_for_compute_capability(
        "RTX 4090", (8, 9), 128, full_name="NVIDIA GeForce RTX 4090",
        l2_bytes=72 * MIB, memory_bytes=24 * GB, memory_bandwidth_gbs=1008, clock_mhz=2520,
    ),
    spec_for_compute_capability(
        "RTX 3090", (8, 6), 82, full_name="NVIDIA GeForce RTX 3090",
        l2_bytes=6 * MIB, memory_bytes=24 * GB, memory_bandwidth_gbs=936, clock_mhz=1695,
    ),
    spec_for_compute_capability(
        "RTX A4000", (8, 6), 48, full_name="NVIDIA RTX A4000",
        aliases=("A4000",),
        l2_bytes=4 * MIB, memory_bytes=16 * GB, memory_bandwidth_gbs=448, clock_mhz=1560,
    ),
    spec_for_compute_capability(
        "V100", (7, 0), 80, full_name="Tesla V100-SXM2-32GB",
        aliases=("V100-SXM2-32GB", "V100 SXM2 32GB", "V100 SXM2"),
        l2_bytes=6 * MIB, memory_bytes=32 * GB, memory_bandwidth_gbs=900, clock_mhz=1530,
    ),
    spec_for_compute_capability(
        "T4", (7, 5), 40, full_name="Tesla T4",
        l2_bytes=4 * MIB, memory_bytes=16 * GB, memory_bandwidth_gbs=320, clock_mhz=1590,
    ),
)  # fmt: skip

# Leading words that name the vendor or a product line, not the model. Dropped from every name
# before matching, and from unknown names before they are stored.
_VENDOR_WORDS = ("nvidia", "tesla", "geforce")
_VENDOR_PREFIX = re.compile(r"^\s*(?:(?:nvidia|tesla|geforce)(?:[\s_-]+|$))+", re.IGNORECASE)


def _match_key(name: str) -> str:
    """Case-, space-, dash- and vendor-insensitive form of a name: "NVIDIA A100-SXM4-80GB" and
    "a100 sxm4 80gb" both give "a100sxm480gb"."""
    key = re.sub(r"[^0-9a-z]+", "", name.lower())
    stripped = True
    while stripped:
        stripped = False
        for word in _VENDOR_WORDS:
            if key.startswith(word) and len(key) > len(word):
                key, stripped = key[len(word) :], True
    return key


def _build_index(catalog: tuple[GpuSpec, ...]) -> dict[str, GpuSpec]:
    index: dict[str, GpuSpec] = {}
    for gpu in catalog:
        for alias in (gpu.name, gpu.full_name, *gpu.aliases):
            key = _match_key(alias)
            other = index.setdefault(key, gpu)
            if other is not gpu:  # pragma: no cover - a catalog edit error, caught by the tests
                raise AssertionError(f"{alias!r} names both {other.name} and {gpu.name}")
    return index


_INDEX = _build_index(_CATALOG)


def list_gpus() -> list[GpuSpec]:
    """Every catalog entry, in catalog order (newest architecture first)."""
    return list(_CATALOG)


def find_gpu(name: str) -> GpuSpec | None:
    """The catalog entry ``name`` refers to (any alias, any case/spacing), or None."""
    return _INDEX.get(_match_key(name))


def get_gpu(name: str) -> GpuSpec:
    """The catalog entry ``name`` refers to.

    Raises:
        UnknownGpu: the catalog does not list it; the message names the models it does.
    """
    gpu = find_gpu(name)
    if gpu is None:
        known = ", ".join(g.name for g in _CATALOG)
        raise UnknownGpu(f"unknown GPU model {name!r}; known models: {known}")
    return gpu


def normalize_gpu_name(name: str) -> str:
    """The canonical model name for ``name``: the catalog name where the catalog knows it
    ("NVIDIA H100 80GB HBM3" -> "H100 SXM"), else ``name`` with the vendor prefix ("NVIDIA",
    "Tesla", "GeForce") dropped and whitespace collapsed ("NVIDIA GeForce RTX 3080" -> "RTX
    3080"), so results from unlisted GPUs are still stored under a stable key. Idempotent.

    Raises:
        InvalidInput: ``name`` is empty or only a vendor prefix.
    """
    gpu = find_gpu(name)
    if gpu is not None:
        return gpu.name
    cleaned = " ".join(_VENDOR_PREFIX.sub("", name).split())
    if not cleaned:
        raise InvalidInput(f"not a GPU model name: {name!r}")
    return cleaned
