"""The index math of the wgmma template's TMA-store epilogue (``EPILOGUE`` 1 in
kernels/matmul/matmul_wgmma.cu), emulated on the CPU: each consumer thread writes its
accumulator pairs to the shared-memory bytes from which a TMA store box with the 128-byte
swizzle reads exactly that (row, column) of the output tile, every byte once, and each warp's
store instruction touches 32 distinct banks. The GPU tests verify the kernel itself."""

from __future__ import annotations

import itertools

import pytest

#: wgmma m64nNk16 float32 accumulators (PTX ISA, "Matrix fragments for wgmma .m64nNk16"):
#: register 4j + 2h + e of warp w, lane l holds row 16w + l/4 + 8h, column 8j + 2(l%4) + e.


def fragment(warp: int, lane: int, j: int, h: int, e: int) -> tuple[int, int]:
    return 16 * warp + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + e


def kernel_address(i: int, warp: int, lane: int, j: int, h: int, rows: int) -> int:
    """The template's byte offset (from its consumer's c_tile) of the 4-byte pair (h: the +8
    row) of fragment j of m64 slice i: chunk j/8 of `rows` x 128 bytes, unit (j%8) ^ r8."""
    r8 = lane // 4
    r = i * 64 + warp * 16 + r8
    at = (j // 8) * rows * 128 + r * 128 + (((j % 8) ^ r8) << 4) + (lane % 4) * 4
    return at + h * 8 * 128


def tma_swizzle_128(row: int, byte: int) -> int:
    """Where a box with 128-byte rows keeps byte `byte` of row `row` in shared memory under
    CU_TENSOR_MAP_SWIZZLE_128B (box start 1024-byte aligned): the 16-byte unit index XOR the
    row index mod 8."""
    return row * 128 + (((byte // 16) ^ (row % 8)) * 16) + byte % 16


@pytest.mark.parametrize(("rows", "bn"), [(64, 64), (64, 128), (64, 256), (128, 128)])
def test_every_element_lands_where_the_tma_store_reads_it(rows, bn):
    """rows: a consumer's rows (BM / CONSUMERS: 64, or 128 for BM 256), bn: the tile width."""
    chunk_bytes = rows * 128
    written: dict[int, tuple[int, int]] = {}
    for i, warp, lane, j, h in itertools.product(
        range(rows // 64), range(4), range(32), range(bn // 8), range(2)
    ):
        at = kernel_address(i, warp, lane, j, h, rows)
        assert at % 4 == 0
        for e in range(2):
            r, col = fragment(warp, lane, j, h, e)
            r += i * 64
            byte_addr = at + 2 * e
            assert byte_addr not in written, "two elements in one place"
            written[byte_addr] = (r, col)
            chunk, x = divmod(col, 64)
            assert byte_addr == chunk * chunk_bytes + tma_swizzle_128(r, 2 * x), (r, col)
    assert len(written) == rows * bn  # every element of the consumer's rows, 2 bytes each
    assert set(written.values()) == {(r, c) for r in range(rows) for c in range(bn)}


@pytest.mark.parametrize("bn", [64, 128, 256])
def test_each_warp_store_hits_32_banks(bn):
    for i, warp, j, h in itertools.product(range(2), range(4), range(bn // 8), range(2)):
        banks = {kernel_address(i, warp, lane, j, h, 128) // 4 % 32 for lane in range(32)}
        assert len(banks) == 32, (i, warp, j, h)


def test_the_template_uses_this_index_math():
    """The expressions emulated above are the template's (a change there must change this)."""
    from kato.kernels.matmul import WGMMA_TEMPLATE

    src = " ".join(WGMMA_TEMPLATE.read_text().split())
    assert "const int r = i * 64 + warp * 16 + r8;" in src
    assert "(j / 8) * kCChunkBytes + r * 128 + (((j % 8) ^ r8) << 4) + (lane % 4) * 4;" in src
    assert "st_shared_u32(at + 8 * 128, pack2(acc[i][4 * j + 2], acc[i][4 * j + 3]));" in src
    assert "constexpr int kCChunkBytes = kRowsPerConsumer * 128;" in src


# --- split-K: the partial sums' trip through distributed shared memory (SPLIT_K > 1) -------


def split_k_layout(consumers: int, acc: int, split: int):
    """The template's split-K addresses (the consumer branch's split-K reduction): consumer warp
    wg = consumer * 4 + warp belongs to CTA wg % split; CTA r sends float4 v of lane l to that
    owner's stage memory at slot * kSlotBytes + (wg / split) * kWarpAccBytes + l * 16 + v * 512,
    slot = r, less one past the owner. Returns {(owner, byte): (source CTA, wg, lane, v)}."""
    warps = 4 * consumers
    owned = -(-warps // split)
    warp_bytes = 32 * acc * 4
    slot_bytes = owned * warp_bytes
    placed = {}
    for r, wg, lane, v in itertools.product(range(split), range(warps), range(32), range(acc // 4)):
        owner = wg % split
        if r == owner:
            continue
        slot = r if r < owner else r - 1
        at = slot * slot_bytes + (wg // split) * warp_bytes + lane * 16 + v * 512
        assert (owner, at) not in placed, "two partials in one place"
        placed[(owner, at)] = (r, wg, lane, v)
        assert at + 16 <= (split - 1) * slot_bytes  # kSplitBufferBytes
    return placed, slot_bytes


@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("tile", [(64, 64), (64, 256), (128, 128), (128, 256), (256, 128)])
def test_split_k_partials_reach_their_owner_once_and_are_read_back_in_cta_order(tile, split):
    from kato.kernels.matmul import (
        wgmma_accumulators,
        wgmma_consumers,
        wgmma_split_buffer_bytes,
    )

    config = {"BM": tile[0], "BN": tile[1], "SPLIT_K": split}
    consumers, acc = wgmma_consumers(config), wgmma_accumulators(config)
    placed, slot_bytes = split_k_layout(consumers, acc, split)
    warps = 4 * consumers
    # every (source CTA, warp, lane, float4) except the owner's own, exactly once
    assert len(placed) == (split - 1) * warps * 32 * (acc // 4)
    # the owner's read of source src (slot src, less one past itself) finds src's values
    for (owner, at), (r, wg, lane, v) in placed.items():
        slot = r if r < owner else r - 1
        assert at == slot * slot_bytes + (wg // split) * 32 * acc * 4 + lane * 16 + v * 512
    # the buffer the spec reserves is what the template's layout needs
    assert wgmma_split_buffer_bytes(config) == (split - 1) * slot_bytes


def test_the_template_uses_this_split_layout():
    from kato.kernels.matmul import WGMMA_TEMPLATE

    src = " ".join(WGMMA_TEMPLATE.read_text().split())
    for line in (
        "const int wg = consumer * 4 + warp;",
        "const int owner = wg % SPLIT_K;",
        "const uint32_t owned_base = smem_base + (wg / SPLIT_K) * kWarpAccBytes + lane * 16;",
        "constexpr int kSlotBytes = kOwnedWarps * kWarpAccBytes;",
        "const int slot = kslice < owner ? kslice : kslice - 1;",
        "const int slot = src < kslice ? src : src - 1;",
        "st_cluster_v4(dst + (i * kVecs + q) * 512,",
        "constexpr int kWarpAccBytes = 32 * kMI * kAccPerWgmma * 4;",
        "constexpr int kOwnedWarps = (kConsumerWarps + SPLIT_K - 1) / SPLIT_K;",
    ):
        assert line in src, line
