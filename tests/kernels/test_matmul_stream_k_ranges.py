"""The stream-K partition of the wgmma template (``STREAM_K`` 1 in
kernels/matmul/matmul_wgmma.cu), run on the CPU: its ``stream_k_range`` (the code itself, cut
from the template and built by g++) gives each CTA a range of the tiles x k blocks iteration
space, and the protocol the kernel runs on those ranges must add up. Here every iteration
belongs to exactly one CTA; each CTA's segments are what the producer and consumers walk; a
tile is stored by exactly one CTA (the one that starts it), whose ``helpers`` are exactly the
CTAs that leave a partial sum of that tile, each its first segment (one workspace slot per
CTA), each after no wait of its own (an owner waits only at the end of its range: no
deadlock while the CTAs are resident); and a tile's partial sums plus its owner's k blocks
cover its k blocks once. The kernel's memory ordering and timing are the GPU tests'."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from kato.kernels.matmul import PERSISTENT_CTAS, STREAM_K_MAX_TILES, WGMMA_TEMPLATE

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

_DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#define __device__
#define __forceinline__ inline
%s
int main(int argc, char** argv) {
    const long long tiles = std::atoll(argv[1]);
    const int k_all = std::atoi(argv[2]), ctas = std::atoi(argv[3]);
    for (int cta = 0; cta < ctas; ++cta) {
        const StreamKRange r = stream_k_range(tiles * k_all, k_all, cta, ctas);
        std::printf("%%d %%d %%d %%d %%d\n", r.first_tile, r.first_k, r.last_tile, r.end_k,
                    r.helpers);
    }
    return 0;
}
"""


def template_range_code() -> str:
    """``StreamKRange`` and ``stream_k_range`` as the template has them."""
    text = WGMMA_TEMPLATE.read_text()
    match = re.search(
        r"^struct StreamKRange \{.*?^\};\n.*?^__device__ __forceinline__ StreamKRange "
        r"stream_k_range\(.*?^\}\n",
        text,
        re.S | re.M,
    )
    assert match, "stream_k_range not found in the template"
    return match.group(0)


@pytest.fixture(scope="module")
def ranges_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("stream_k")
    (workdir / "ranges.cpp").write_text(_DRIVER % template_range_code())
    subprocess.run(
        ["g++", "-std=c++17", "-O1", "-o", str(workdir / "ranges"), str(workdir / "ranges.cpp")],
        check=True,
        capture_output=True,
    )
    return workdir / "ranges"


def ranges(binary: Path, tiles: int, k_all: int, ctas: int) -> list[tuple[int, ...]]:
    out = subprocess.run(
        [str(binary), str(tiles), str(k_all), str(ctas)], check=True, capture_output=True
    ).stdout
    return [tuple(int(v) for v in line.split()) for line in out.decode().splitlines()]


def segments(r: tuple[int, ...], k_all: int) -> list[tuple[int, int, int]]:
    """(tile, first k block, end k block) of each segment, as the kernel's loops walk them."""
    first_tile, first_k, last_tile, end_k, _ = r
    return [
        (tile, first_k if tile == first_tile else 0, end_k if tile == last_tile else k_all)
        for tile in range(first_tile, last_tile + 1)
    ]


def check_protocol(rows: list[tuple[int, ...]], tiles: int, k_all: int) -> None:
    """The properties of the module docstring, for one partition."""
    pieces: dict[int, list[tuple[int, int]]] = {t: [] for t in range(tiles)}  # k ranges run
    stored: dict[int, list[int]] = {t: [] for t in range(tiles)}
    partial: dict[int, list[int]] = {t: [] for t in range(tiles)}  # tile -> CTAs with a slot
    owners: dict[int, tuple[int, int, int]] = {}  # tile -> (cta, its k blocks' end, helpers)
    previous_end = 0
    for cta, r in enumerate(rows):
        segs = segments(r, k_all)
        assert segs, f"CTA {cta}: an empty range"
        begin = segs[0][0] * k_all + segs[0][1]
        assert begin == previous_end, f"CTA {cta} starts at {begin}, not {previous_end}"
        previous_end = segs[-1][0] * k_all + segs[-1][2]
        for index, (tile, k0, k1) in enumerate(segs):
            assert 0 <= k0 < k1 <= k_all, (cta, tile, k0, k1)
            pieces[tile].append((k0, k1))
            if k0 != 0:  # a partial sum: only a CTA's first segment, one slot per CTA
                assert index == 0, f"CTA {cta}: a partial sum in segment {index}"
                partial[tile].append(cta)
            elif k1 != k_all:  # the owner: the range's last segment (it waits at the end)
                assert index == len(segs) - 1, f"CTA {cta}: an owner segment before the last"
                owners[tile] = (cta, k1, r[4])
                stored[tile].append(cta)
            else:
                stored[tile].append(cta)
        owner_segment = segs[-1][1] == 0 and segs[-1][2] != k_all
        assert (r[4] > 0) == owner_segment, f"CTA {cta}: helpers {r[4]}, owner {owner_segment}"
    assert previous_end == tiles * k_all
    for tile, runs in pieces.items():  # the k blocks of a tile, each run once
        ends = [0] + [k1 for _, k1 in sorted(runs)]
        assert [k0 for k0, _ in sorted(runs)] == ends[:-1] and ends[-1] == k_all, (tile, runs)
    for tile in range(tiles):
        assert len(stored[tile]) == 1, f"tile {tile} stored by {stored[tile]}"
        if tile in owners:
            cta, _, helpers = owners[tile]
            # the owner reads the slots of CTAs cta + 1 .. cta + helpers: exactly the partials
            read = list(range(cta + 1, cta + 1 + helpers))
            assert partial[tile] == read, (
                f"tile {tile}: the owner adds {read}, {partial[tile]} wrote"
            )
        else:
            assert partial[tile] == [], f"tile {tile}: partial sums nobody adds"


@pytest.mark.parametrize(
    ("tiles", "k_all", "ctas"),
    [
        (72, 128, PERSISTENT_CTAS),  # issue 32: 768 x 3072 x 8192 in 128 x 256 tiles
        (144, 128, PERSISTENT_CTAS),  # the same in 128 x 128 tiles: 1.09 waves
        (1, 132, PERSISTENT_CTAS),  # one tile, one k block per CTA: every range inside it
        (1, 1000, PERSISTENT_CTAS),  # one tile, ranges of 7-8 k blocks
        (72, 2, PERSISTENT_CTAS),  # 144 iterations: ranges of one or two k blocks
        (133, 1, PERSISTENT_CTAS),  # one k block per tile: whole tiles only, no partials
        (133, 5, PERSISTENT_CTAS),  # ranges just over one tile
        (STREAM_K_MAX_TILES - 1, 3, PERSISTENT_CTAS),
        (36, 33_554_431, PERSISTENT_CTAS),  # K near 2**31: 64-bit products
        (7, 19, 5),  # a grid of fewer CTAs than SMs
        (3, 4, 12),  # ctas == iterations
    ],
)
def test_stream_k_ranges_partition_the_iterations(ranges_binary, tiles, k_all, ctas):
    rows = ranges(ranges_binary, tiles, k_all, ctas)
    assert len(rows) == ctas
    check_protocol(rows, tiles, k_all)


def test_the_issue_shape_splits_every_tile_in_two_or_three(ranges_binary):
    """72 tiles of 128 k blocks on 132 CTAs: 69-70 k blocks per CTA, so each tile has an owner
    and one or two helpers, and no CTA stores a tile alone."""
    rows = ranges(ranges_binary, 72, 128, PERSISTENT_CTAS)
    lengths = {(r[2] * 128 + r[3]) - (r[0] * 128 + r[1]) for r in rows}
    assert lengths == {69, 70}
    helpers = [r[4] for r in rows if r[4]]
    assert len(helpers) == 72 and set(helpers) <= {1, 2}


def test_the_check_protocol_catches_a_wrong_helper_count(ranges_binary):
    """The protocol check fails where an owner would wait for one CTA too many."""
    rows = ranges(ranges_binary, 72, 128, PERSISTENT_CTAS)
    owner = next(i for i, r in enumerate(rows) if r[4])
    rows[owner] = (*rows[owner][:4], rows[owner][4] + 1)
    with pytest.raises(AssertionError, match="tile"):
        check_protocol(rows, 72, 128)


#: The template's guard before its partition: past it, a slot or a counter would be shared or a
#: range empty, so the kernel traps (the host's check() and launch must keep every config clear).
TEMPLATE_GUARD = (
    "if (gridDim.x > STREAM_K_CTAS || num_tiles > STREAM_K_MAX_TILES || total < gridDim.x)"
)


def test_every_config_check_accepts_launches_a_grid_the_kernel_runs(ranges_binary):
    """Over random shapes (random multiples of 8, so every layout's TMA pitches hold), every
    STREAM_K=1 tile and epilogue that check() accepts launches a grid the template's guard lets
    through (no trap) and on which its partition keeps the protocol."""
    import math
    import random

    from kato.kernels import get_operator
    from kato.kernels.matmul import WGMMA_BK, wgmma_cluster_tiles

    assert TEMPLATE_GUARD in WGMMA_TEMPLATE.read_text()
    spec = get_operator("matmul_tn")
    configs = {
        (c["BM"], c["BN"], c["EPILOGUE"]): c
        for c in spec.candidates((1000, 1000, 1000), "bfloat16")
        if c["ENGINE"] == "wgmma"
        and c["STREAM_K"]
        and spec.check(c, (1000, 1000, 1000), "bfloat16") is None
    }
    rng = random.Random(32)
    partitions, accepted = set(), 0
    for _ in range(60):
        shape = tuple(8 * rng.randint(1, 1 << rng.randint(3, 10)) for _ in range(3))
        for config in configs.values():
            if spec.check(config, shape, "bfloat16") is not None:
                continue
            accepted += 1
            tiles = wgmma_cluster_tiles(config, shape[0], shape[1])
            k_all = math.ceil(shape[2] / WGMMA_BK)
            (grid, _, _) = spec.launch(config, shape, "bfloat16").grid
            trapped = grid > PERSISTENT_CTAS or tiles > STREAM_K_MAX_TILES or tiles * k_all < grid
            assert not trapped, (shape, config, grid)
            partitions.add((tiles, k_all, grid))
    assert accepted > 50 and len(partitions) > 20, (accepted, len(partitions))
    for tiles, k_all, grid in sorted(partitions):
        check_protocol(ranges(ranges_binary, tiles, k_all, grid), tiles, k_all)
