"""The occupancy calculator: hand-computed cases, and the driver's answers recorded on an H200.

The hand-computed expectations follow cuda_occupancy.h (cudaOccMaxActiveBlocksPerMultiprocessor)
step by step. H200 (cc 9.0) figures used below: 64 warps and 32 blocks per SM; 65536 registers
in 4 sub-partitions of 16384, allocated per warp in units of 256; 228 KiB (233472 B) of shared
memory per SM at the largest carveout, 227 KiB (232448 B) per block after opt-in, 1 KiB reserved
by the driver per block, allocated in units of 128 B.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kato.kernels.spec import InvalidInput
from kato.tuner.occupancy import (
    Occupancy,
    carveout_percent,
    max_dynamic_shared_for,
    occupancy,
    shared_allocated_per_block,
)

from kato.shared.gpus import get_gpu

H200 = get_gpu("H200")
KIB = 1024
DRIVER_TABLE = Path(__file__).parent / "data" / "occupancy_h200.json"


def check(occ: Occupancy, blocks: int, limiter: str, fraction: float | None = None) -> None:
    assert occ.blocks_per_sm == blocks
    assert occ.limiter == limiter
    assert occ.active_warps == blocks * occ.warps_per_block
    assert occ.fraction == pytest.approx(
        fraction if fraction is not None else occ.active_warps / occ.max_warps
    )
    assert (occ.reason is None) == (blocks > 0)


# --- warps, blocks and registers ------------------------------------------------------------


def test_threads_limited() -> None:
    # 256 threads = 8 warps: 64 // 8 = 8 blocks. Registers: 32 * 32 = 1024 per warp, 16384 //
    # 1024 = 16 warps per sub-partition, 64 per SM, also 8 blocks. Shared: only the 1 KiB
    # reserved per block, 233472 // 1024 = 228. Tie between warps and registers; 100 %.
    occ = occupancy(H200, 256, 32, 0)
    check(occ, 8, "warps", 1.0)
    assert occ.limiters == ("warps", "registers")
    assert (occ.limit_warps, occ.limit_registers, occ.limit_shared, occ.limit_blocks) == (
        8,
        8,
        228,
        32,
    )
    assert occ.registers_per_block == 8 * 1024
    assert occ.shared_per_block == 1024


def test_max_registers_per_thread() -> None:
    # 255 regs: 255 * 32 = 8160, rounded up to 8192 per warp; 16384 // 8192 = 2 warps per
    # sub-partition, 8 per SM; 128 threads = 4 warps -> 2 blocks, 8 / 64 warps = 12.5 %.
    check(occupancy(H200, 128, 255, 0), 2, "registers", 0.125)


def test_registers_are_allocated_per_sub_partition() -> None:
    # 192 regs: 6144 per warp. Per SM 65536 // 6144 = 10 warps would give 5 blocks of 2 warps,
    # but each sub-partition holds 16384 // 6144 = 2 warps: 8 per SM -> 4 blocks.
    occ = occupancy(H200, 64, 192, 0)
    check(occ, 4, "registers", 8 / 64)
    assert occ.limit_registers == 4


def test_registers_rounded_up_per_warp() -> None:
    # 33 regs: 33 * 32 = 1056 -> 1280 per warp (5 units of 256); 16384 // 1280 = 12 per
    # sub-partition, 48 warps per SM; 256 threads = 8 warps -> 6 blocks (not 7 or 8).
    check(occupancy(H200, 256, 33, 0), 6, "registers", 48 / 64)
    # 40 regs round to the same 1280: same answer.
    assert occupancy(H200, 256, 40, 0).blocks_per_sm == 6


def test_full_block_at_64_registers() -> None:
    # 1024 threads = 32 warps x 2048 regs = 65536: exactly the per-block limit; the SM holds 8
    # warps per sub-partition = 32 -> 1 block, 50 %.
    check(occupancy(H200, 1024, 64, 0), 1, "registers", 0.5)


def test_zero_too_many_registers_per_block() -> None:
    # 65 regs -> 2304 per warp x 32 warps = 73728 > 65536 registers per block.
    occ = occupancy(H200, 1024, 65, 0)
    check(occ, 0, "none", 0.0)
    assert occ.limiters == ("registers",)
    assert "registers" in occ.reason and "65536" in occ.reason


def test_zero_hardware_register_check_rounds_warps_to_four() -> None:
    # 288 threads = 9 warps x 5632 regs (176 per thread) = 50688 fits the block limit in
    # software, but the hardware counts warps in groups of 4: 12 x 5632 = 67584 > 65536.
    occ = occupancy(H200, 288, 176, 0)
    check(occ, 0, "none")
    assert "67584" in occ.reason
    # One warp fewer (8, already a multiple of 4): 8 x 5632 = 45056 fits; 2 warps per
    # sub-partition -> 8 warps per SM -> 1 block.
    assert occupancy(H200, 256, 176, 0).blocks_per_sm == 1


def test_zero_registers_per_thread_above_255() -> None:
    occ = occupancy(H200, 32, 256, 0)
    check(occ, 0, "none")
    assert "255" in occ.reason


def test_zero_too_many_threads() -> None:
    occ = occupancy(H200, 1025, 16, 0)
    check(occ, 0, "none")
    assert occ.limiters == ("warps",)
    assert "1025 threads" in occ.reason and "1024" in occ.reason


def test_blocks_limited() -> None:
    # 32 threads, 16 regs: warps allow 64 blocks, registers 16384 // 512 * 4 = 128; the SM
    # holds at most 32 blocks -> 32 warps, 50 %.
    occ = occupancy(H200, 32, 16, 0)
    check(occ, 32, "blocks", 0.5)
    assert occ.limiters == ("blocks",)


def test_partial_warps_count_as_whole() -> None:
    # 100 threads occupy 4 warps: 64 // 4 = 16 blocks, 64 active warps.
    occ = occupancy(H200, 100, 32, 0)
    check(occ, 16, "warps", 1.0)
    assert occ.warps_per_block == 4


def test_no_registers_sets_no_register_limit() -> None:
    occ = occupancy(H200, 32, 0, 0)
    assert occ.limit_registers is None
    check(occ, 32, "blocks")


# --- shared memory ---------------------------------------------------------------------------


def test_shared_limited_48k() -> None:
    # 48 KiB + 1 KiB reserved = 50176 B per block; 233472 // 50176 = 4 blocks (registers would
    # allow 8): 32 warps, 50 %.
    occ = occupancy(H200, 256, 32, 48 * KIB)
    check(occ, 4, "shared", 0.5)
    assert occ.shared_per_block == 50176
    assert occ.shared_per_sm == 233472


def test_shared_rounding_and_reserved_bytes() -> None:
    # 7000 B + 1024 reserved = 8024, rounded up to 128 B: 8064. 233472 // 8064 = 28 blocks.
    # (Without the rounding 29; without the reserved bytes 7040 -> 33, then the 32-block limit.)
    occ = occupancy(H200, 64, 32, 7000)
    check(occ, 28, "shared")
    assert occ.shared_per_block == 8064
    assert shared_allocated_per_block(H200, 7000) == 8064


def test_shared_at_the_opt_in_maximum() -> None:
    # 227 KiB + 1 KiB reserved = the whole 228 KiB: one block.
    check(occupancy(H200, 256, 32, 227 * KIB), 1, "shared", 8 / 64)


def test_zero_shared_above_opt_in_maximum() -> None:
    occ = occupancy(H200, 256, 32, 227 * KIB + 1)
    check(occ, 0, "none")
    assert occ.limiters == ("shared",)
    assert "232449 bytes" in occ.reason and "232448" in occ.reason and "reserved" in occ.reason


def test_zero_reason_names_every_cause() -> None:
    occ = occupancy(H200, 2048, 255, 300 * KIB)
    assert occ.blocks_per_sm == 0
    assert set(occ.limiters) == {"warps", "registers", "shared"}
    assert "threads" in occ.reason and "registers" in occ.reason and "shared" in occ.reason


# --- shared-memory carveout ------------------------------------------------------------------


def test_default_carveout_is_the_maximum() -> None:
    for pref in ("max", "default", -1, 100):
        assert occupancy(H200, 128, 32, 20000, pref).shared_per_sm == 233472
    # 20000 + 1024 -> 21120 per block; 233472 // 21120 = 11.
    assert occupancy(H200, 128, 32, 20000).blocks_per_sm == 11


def test_carveout_half() -> None:
    # 50 % of 233472 = 116736, rounded up to the next size Hopper supports: 132 KiB = 135168.
    # 135168 // 21120 = 6 blocks.
    for pref in (50, "half"):
        occ = occupancy(H200, 128, 32, 20000, pref)
        assert occ.shared_per_sm == 132 * KIB
        check(occ, 6, "shared")


def test_carveout_too_small_falls_back_to_one_that_fits() -> None:
    # 25 % -> 58368 -> 64 KiB. A block of 41088 B fits once.
    assert occupancy(H200, 128, 32, 40000, 25).blocks_per_sm == 1
    # 70000 + 1024 -> 71040 B does not fit 64 KiB: the preference is only a hint, the driver
    # configures the smallest carveout holding one block (100 KiB): still 1 block, never 0.
    occ = occupancy(H200, 128, 32, 70000, 25)
    check(occ, 1, "shared")
    assert occ.shared_per_sm == 100 * KIB


def test_carveout_min() -> None:
    # 0 % -> 0 KiB, smaller than even the reserved 1 KiB of a block: the smallest carveout
    # holding one block is 8 KiB, which holds 8 blocks of 1 KiB.
    occ = occupancy(H200, 128, 32, 0, "min")
    assert occ.shared_per_sm == 8 * KIB
    check(occ, 8, "shared", 32 / 64)
    assert occupancy(H200, 128, 32, 0, 0).blocks_per_sm == 8


@pytest.mark.parametrize("pref", ["bogus", 101, -2, True, 50.0])
def test_carveout_rejects_bad_preferences(pref: Any) -> None:
    with pytest.raises(InvalidInput):
        occupancy(H200, 128, 32, 0, pref)


def test_carveout_percent() -> None:
    assert carveout_percent("max") is None
    assert carveout_percent("default") is None
    assert carveout_percent(-1) is None
    assert carveout_percent("half") == 50
    assert carveout_percent("min") == 0
    assert carveout_percent(75) == 75


# --- other architectures -----------------------------------------------------------------------


def test_a100() -> None:
    a100 = get_gpu("A100 80GB")
    check(occupancy(a100, 256, 32, 0), 8, "warps", 1.0)
    # 164 KiB = 167936 // 50176 = 3 blocks.
    check(occupancy(a100, 256, 32, 48 * KIB), 3, "shared")
    assert occupancy(a100, 256, 32, 163 * KIB).blocks_per_sm == 1
    assert occupancy(a100, 256, 32, 163 * KIB + 1).blocks_per_sm == 0


def test_ada_has_48_warps_and_24_blocks() -> None:
    rtx4090 = get_gpu("RTX 4090")
    check(occupancy(rtx4090, 256, 32, 0), 6, "warps", 1.0)
    occ = occupancy(rtx4090, 64, 16, 0)  # 48 // 2 = 24 = the block limit
    check(occ, 24, "warps", 1.0)
    assert occ.limiters == ("warps", "blocks")
    check(occupancy(rtx4090, 32, 16, 0), 24, "blocks", 0.5)
    # 100 KiB per SM: 49152 + 1024 = 50176 -> 2 blocks; 99 KiB is the per-block maximum.
    assert occupancy(rtx4090, 128, 32, 48 * KIB).blocks_per_sm == 2
    assert occupancy(rtx4090, 128, 32, 99 * KIB + 1).blocks_per_sm == 0


def test_ampere_consumer_has_16_blocks() -> None:
    check(occupancy(get_gpu("RTX 3090"), 32, 16, 0), 16, "blocks", 16 / 48)


def test_turing_t4() -> None:
    t4 = get_gpu("T4")
    # 1024 threads per SM: 256-thread blocks -> 4.
    check(occupancy(t4, 256, 32, 0), 4, "warps", 1.0)
    # No reserved bytes before cc 8.0, 256 B units: 100 B -> 256 B.
    assert occupancy(t4, 64, 32, 100).shared_per_block == 256
    assert occupancy(t4, 64, 32, 0).limit_shared is None
    # 32 KiB -> 2 blocks of 64 KiB.
    check(occupancy(t4, 128, 32, 32 * KIB), 2, "shared")
    # Turing's smallest carveout is 32 KiB.
    assert occupancy(t4, 128, 32, 20000, "min").shared_per_sm == 32 * KIB


def test_volta_v100() -> None:
    v100 = get_gpu("V100")
    check(occupancy(v100, 256, 32, 0), 8, "warps", 1.0)
    check(occupancy(v100, 256, 32, 48 * KIB), 2, "shared")  # 96 KiB per SM, no reserve


# --- input validation --------------------------------------------------------------------------


@pytest.mark.parametrize(("threads", "regs", "smem"), [(0, 32, 0), (32, -1, 0), (32, 32, -1)])
def test_rejects_negative_sizes(threads: int, regs: int, smem: int) -> None:
    with pytest.raises(InvalidInput):
        occupancy(H200, threads, regs, smem)


# --- max_dynamic_shared_for --------------------------------------------------------------------


def test_max_dynamic_shared_for_h200() -> None:
    assert max_dynamic_shared_for(H200, 1) == 227 * KIB  # the opt-in maximum
    # 233472 // 2 = 116736 per block, less the reserved 1 KiB.
    assert max_dynamic_shared_for(H200, 2) == 116736 - 1024
    assert max_dynamic_shared_for(H200, 2, static_bytes=4096) == 116736 - 1024 - 4096
    # 233472 // 32 = 7296 (a multiple of 128) - 1024.
    assert max_dynamic_shared_for(H200, 32) == 6272
    assert max_dynamic_shared_for(H200, 33) is None  # more than the SM's 32 blocks
    assert max_dynamic_shared_for(H200, 1, static_bytes=227 * KIB + 1) is None
    # With the L1-heavy carveout, two blocks share the 8 KiB carveout chosen for one block.
    assert max_dynamic_shared_for(H200, 2, shared_carveout="min") == 4096 - 1024
    with pytest.raises(InvalidInput):
        max_dynamic_shared_for(H200, 0)


@pytest.mark.parametrize("gpu_name", ["H200", "A100 80GB", "RTX 4090", "T4", "V100"])
@pytest.mark.parametrize("carveout", ["max", 50, 0])
def test_max_dynamic_shared_for_inverts_occupancy(gpu_name: str, carveout: str | int) -> None:
    gpu = get_gpu(gpu_name)
    for blocks in (1, 2, 3, 5, 8, 13, gpu.max_blocks_per_sm):
        for static in (0, 1000, 12288):
            d = max_dynamic_shared_for(gpu, blocks, static, carveout)
            if d is None:
                assert occupancy(gpu, 32, 16, static, carveout).limit_shared < blocks
                continue
            limit = occupancy(gpu, 32, 16, static + d, carveout).limit_shared
            assert limit is None or limit >= blocks
            after = occupancy(gpu, 32, 16, static + d + 1, carveout).limit_shared
            assert after is not None and after < blocks


# --- the driver's own answers, recorded on an H200 ----------------------------------------------


def load_driver_table() -> dict[str, Any]:
    if not DRIVER_TABLE.exists():
        pytest.skip("driver table not recorded yet")
    return json.loads(DRIVER_TABLE.read_text())


def test_matches_driver_table() -> None:
    """Every configuration ``benchmarks/occupancy_check.py`` asked the driver about."""
    table = load_driver_table()
    gpu = get_gpu(table["device"]["model"])
    rows = [r for r in table["rows"] if r.get("driver_blocks_per_sm") is not None]
    assert len({r["name"] for r in rows}) >= 60, "expected the full probe family"
    mismatches = []
    for r in rows:
        carveout = "max" if r.get("carveout") is None else r["carveout"]
        shared = r["shared_static_bytes"] + r["dynamic_shared_bytes"]
        occ = occupancy(gpu, r["threads_per_block"], r["registers"], shared, carveout)
        if occ.blocks_per_sm != r["driver_blocks_per_sm"]:
            mismatches.append(
                f"{r['name']} threads={r['threads_per_block']} regs={r['registers']} "
                f"smem={r['shared_static_bytes']}+{r['dynamic_shared_bytes']} "
                f"carveout={r.get('carveout')}: driver {r['driver_blocks_per_sm']}, "
                f"kato {occ.blocks_per_sm} ({occ.limiter})"
            )
    assert not mismatches, f"{len(mismatches)} of {len(rows)} differ:\n" + "\n".join(
        mismatches[:30]
    )


def test_catalog_matches_recorded_device() -> None:
    """The catalog entry agrees with the attributes the device reported."""
    table = load_driver_table()
    device = table["device"]
    gpu = get_gpu(device["model"])
    attrs = device["attributes"]
    assert list(gpu.compute_capability) == device["compute_capability"]
    for field in (
        "sm_count",
        "max_threads_per_sm",
        "max_blocks_per_sm",
        "registers_per_sm",
        "max_registers_per_block",
        "shared_per_block_bytes",
        "shared_per_sm_bytes",
        "shared_per_block_optin_bytes",
        "shared_reserved_per_block_bytes",
        "l2_bytes",
    ):
        assert getattr(gpu, field) == attrs[field], field
