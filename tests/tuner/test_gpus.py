"""The GPU catalog: name normalisation, lookups, and the self-consistency of every entry."""

from __future__ import annotations

import dataclasses
import json

import pytest
from kato.kernels.spec import InvalidInput

from kato.shared.gpus import (
    GpuSpec,
    UnknownGpu,
    find_gpu,
    get_gpu,
    known_compute_capabilities,
    list_gpus,
    normalize_gpu_name,
    spec_for_compute_capability,
)

KIB = 1024
MIB = 1024 * KIB


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        # what the drivers report
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("GeForce RTX 3090", "RTX 3090"),
        ("NVIDIA RTX A4000", "RTX A4000"),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("Tesla T4", "T4"),
        # canonical names map to themselves
        ("H200", "H200"),
        ("H100 SXM", "H100 SXM"),
        ("A100 80GB", "A100 80GB"),
        ("RTX A4000", "RTX A4000"),
        # case, spaces, dashes and underscores do not matter
        ("nvidia h200", "H200"),
        ("  NVIDIA   H200 ", "H200"),
        ("h100-sxm", "H100 SXM"),
        ("a100_sxm4_80gb", "A100 80GB"),
        ("A100 SXM4 80GB", "A100 80GB"),
        ("rtx-4090", "RTX 4090"),
        ("NVIDIA-GEFORCE-RTX-4090", "RTX 4090"),
        ("v100 sxm2 32gb", "V100"),
        ("t4", "T4"),
    ],
)
def test_normalize_known_names(name: str, canonical: str) -> None:
    assert normalize_gpu_name(name) == canonical
    assert get_gpu(name).name == canonical


@pytest.mark.parametrize(
    ("name", "cleaned"),
    [
        ("NVIDIA GeForce RTX 3080", "RTX 3080"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),  # not the SXM board the catalog lists
        ("Tesla P100-PCIE-16GB", "P100-PCIE-16GB"),
        ("NVIDIA  B200", "B200"),
        ("Quadro RTX 8000", "Quadro RTX 8000"),
    ],
)
def test_normalize_unknown_names_strips_vendor(name: str, cleaned: str) -> None:
    assert find_gpu(name) is None
    assert normalize_gpu_name(name) == cleaned
    assert normalize_gpu_name(cleaned) == cleaned  # idempotent: a stored key stays the key


@pytest.mark.parametrize("name", ["", "   ", "NVIDIA", "nvidia geforce"])
def test_normalize_rejects_empty_names(name: str) -> None:
    with pytest.raises(InvalidInput):
        normalize_gpu_name(name)


def test_get_gpu_unknown_lists_known_models() -> None:
    with pytest.raises(UnknownGpu) as info:
        get_gpu("NVIDIA B200")
    assert isinstance(info.value, InvalidInput)  # the service answers 422
    message = str(info.value)
    assert "B200" in message
    for gpu in list_gpus():
        assert gpu.name in message


def test_find_gpu_returns_none_for_unknown() -> None:
    assert find_gpu("Radeon RX 7900 XTX") is None
    assert find_gpu("H200") is get_gpu("NVIDIA H200")


def test_catalog_lists_the_required_models() -> None:
    names = [gpu.name for gpu in list_gpus()]
    required = {
        "H200", "H100 SXM", "H100 PCIe", "A100 80GB", "A100 40GB", "L40S", "L4",
        "RTX 4090", "RTX 3090", "RTX A4000", "V100", "T4",
    }  # fmt: skip
    assert required <= set(names)
    assert len(names) == len(set(names))


def test_every_alias_resolves_to_its_entry() -> None:
    for gpu in list_gpus():
        for alias in (gpu.name, gpu.full_name, *gpu.aliases):
            assert find_gpu(alias) is gpu, alias
            assert normalize_gpu_name(alias) == gpu.name
        # the driver's name is what normalisation sees most
        assert normalize_gpu_name(gpu.full_name) == gpu.name


@pytest.mark.parametrize(
    ("name", "cc", "sms", "threads_per_sm", "blocks_per_sm", "smem_sm_kib", "optin_kib"),
    [
        # CUDA C++ Programming Guide, Technical Specifications per Compute Capability
        ("H200", (9, 0), 132, 2048, 32, 228, 227),
        ("H100 SXM", (9, 0), 132, 2048, 32, 228, 227),
        ("H100 PCIe", (9, 0), 114, 2048, 32, 228, 227),
        ("A100 80GB", (8, 0), 108, 2048, 32, 164, 163),
        ("A100 40GB", (8, 0), 108, 2048, 32, 164, 163),
        ("L40S", (8, 9), 142, 1536, 24, 100, 99),
        ("L4", (8, 9), 58, 1536, 24, 100, 99),
        ("RTX 4090", (8, 9), 128, 1536, 24, 100, 99),
        ("RTX 3090", (8, 6), 82, 1536, 16, 100, 99),
        ("RTX A4000", (8, 6), 48, 1536, 16, 100, 99),
        ("V100", (7, 0), 80, 2048, 32, 96, 96),
        ("T4", (7, 5), 40, 1024, 16, 64, 64),
    ],
)
def test_catalog_figures(
    name: str,
    cc: tuple[int, int],
    sms: int,
    threads_per_sm: int,
    blocks_per_sm: int,
    smem_sm_kib: int,
    optin_kib: int,
) -> None:
    gpu = get_gpu(name)
    assert gpu.compute_capability == cc
    assert gpu.arch == f"sm_{cc[0]}{cc[1]}"
    assert gpu.sm_count == sms
    assert gpu.max_threads_per_sm == threads_per_sm
    assert gpu.max_blocks_per_sm == blocks_per_sm
    assert gpu.shared_per_sm_bytes == smem_sm_kib * KIB
    assert gpu.shared_per_block_optin_bytes == optin_kib * KIB


def test_headline_figures_of_the_main_gpus() -> None:
    h200, h100, a100 = get_gpu("H200"), get_gpu("H100 SXM"), get_gpu("A100 80GB")
    assert (h200.memory_bandwidth_gbs, h200.l2_bytes, h200.memory_bytes) == (4800, 60 * MIB, 141e9)
    assert (h100.memory_bandwidth_gbs, h100.l2_bytes, h100.memory_bytes) == (3350, 50 * MIB, 80e9)
    assert (a100.memory_bandwidth_gbs, a100.l2_bytes) == (2039, 40 * MIB)


@pytest.mark.parametrize("gpu", list_gpus(), ids=lambda g: g.name)
def test_entry_is_self_consistent(gpu: GpuSpec) -> None:
    major, _ = gpu.compute_capability
    assert gpu.warp_size == 32
    assert gpu.max_warps_per_sm * gpu.warp_size == gpu.max_threads_per_sm
    assert gpu.max_threads_per_block == 1024 <= gpu.max_threads_per_sm
    assert gpu.max_blocks_per_sm * gpu.warp_size <= gpu.max_threads_per_sm
    # registers
    assert gpu.registers_per_sm == gpu.max_registers_per_block == 65536
    assert gpu.max_registers_per_thread == 255
    assert gpu.register_alloc_unit == 256
    assert gpu.registers_per_sm % (gpu.warp_alloc_granularity * gpu.register_alloc_unit) == 0
    # shared memory: 48 KiB static <= opt-in <= per SM; opt-in is per SM minus the reserved bytes
    assert gpu.shared_per_block_bytes == 48 * KIB <= gpu.shared_per_block_optin_bytes
    assert gpu.shared_per_block_optin_bytes <= gpu.shared_per_sm_bytes
    reserved = 1 * KIB if major >= 8 else 0
    assert gpu.shared_reserved_per_block_bytes == reserved
    assert gpu.shared_per_block_optin_bytes + reserved == gpu.shared_per_sm_bytes
    assert gpu.shared_alloc_unit_bytes == (128 if major >= 8 else 256)
    assert gpu.shared_per_sm_bytes % gpu.shared_alloc_unit_bytes == 0
    carveouts = gpu.shared_carveouts_kib
    assert list(carveouts) == sorted(set(carveouts))
    assert carveouts[-1] * KIB == gpu.shared_per_sm_bytes
    # headline figures present and plausible
    assert gpu.sm_count > 0 and gpu.l2_bytes >= 4 * MIB
    assert gpu.memory_bytes >= 16e9 and gpu.memory_bandwidth_gbs >= 300
    assert gpu.clock_mhz is None or 1000 <= gpu.clock_mhz <= 3000
    assert gpu.full_name and gpu.name


@pytest.mark.parametrize("gpu", list_gpus(), ids=lambda g: g.name)
def test_to_dict_is_json_ready(gpu: GpuSpec) -> None:
    d = gpu.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["name"] == gpu.name
    assert d["arch"] == gpu.arch
    assert d["max_warps_per_sm"] == gpu.max_warps_per_sm
    assert d["compute_capability"] == list(gpu.compute_capability)
    assert {f.name for f in dataclasses.fields(GpuSpec)} <= set(d)


def test_spec_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_gpu("H200").sm_count = 1  # type: ignore[misc]


def test_spec_for_compute_capability() -> None:
    gpu = spec_for_compute_capability("GH200", (9, 0), 132, full_name="NVIDIA GH200 480GB")
    assert gpu.arch == "sm_90"
    assert gpu.shared_per_sm_bytes == get_gpu("H200").shared_per_sm_bytes
    assert (9, 0) in known_compute_capabilities()
    with pytest.raises(InvalidInput, match="compute capability 12.0"):
        spec_for_compute_capability("RTX 5090", (12, 0), 170)
