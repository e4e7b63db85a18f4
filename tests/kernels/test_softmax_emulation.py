"""Softmax's sub-warp row groups (``LANES`` 4, 8, 16: several rows per warp, issue 31) on the
CPU: the real template compiled as host C++ against tests/kernels/cuda_emulation.py, every
(dtype, LANES, CACHE) on short and awkward rows (1, 3, 7, 9 and 31 columns, odd row counts, a
split row whose head moves from row to row, x and y shifted off a 16-byte boundary), a third of
the cases on a one-block grid (the grid-stride loop, and row groups of a warp past the last
row), verified against the float64 reference with the spec's tolerances as the GPU backend
verifies. ``LANES=32`` (a warp per row) is test_softmax_compile.py's emulation.

Split rows (STRATEGY 2, a block per piece of a row, two launches) run here too: one, three and
a few rows, odd and prime row lengths, pieces of unequal length, every dtype, every
MIN_BLOCKS (the grid's blocks per SM), both launches as ``spec.steps`` gives them."""

from __future__ import annotations

import itertools
import random
import shutil

import cuda_emulation
import numpy as np
import pytest
from cuda_emulation import Case, run_cases
from kato.kernels import get_operator
from kato.kernels.softmax import split_parts

SPEC = get_operator("softmax")
SUB_WARP = (4, 8, 16)
#: Odd row counts; rows shorter than a warp (the case LANES is for), and longer ones whose
#: streaming loop takes several steps per row group.
SHAPES = ((7, 7), (5, 1), (9, 3), (33, 9), (3, 31), (13, 7), (11, 203), (3, 1031))
#: Element offsets of x and y past a 16-byte boundary for split rows (congruent, as a view's).
OFFSETS = (1, 3)
#: Device functions the template uses beyond cuda_emulation.HEADER and NORM_EXTRA.
EXTRA = "\ninline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }\n"


def cases(seed: int = 0) -> list[Case]:
    """One valid case per (dtype, LANES, CACHE) and shape of :data:`SHAPES` (rotated), the
    vector width and block size seeded; split rows shifted by an offset, every third case on
    one block."""
    rnd = random.Random(seed)
    found: list[Case] = []
    for dtype, lanes, cache in itertools.product(SPEC.dtypes, SUB_WARP, SPEC.params["CACHE"]):
        for _ in range(2):  # two shapes per combination
            start = len(found) % len(SHAPES)
            for shape in SHAPES[start:] + SHAPES[:start]:
                config = None
                for vec in rnd.sample([8, 4, 2, 1], 4):
                    trial = {
                        "BLOCK_SIZE": rnd.choice((32, 64, 128)),  # threads are host threads
                        "VEC": vec,
                        "STRATEGY": 0,
                        "CACHE": cache,
                        "MIN_BLOCKS": 0,
                        "LANES": lanes,
                    }
                    if SPEC.check(trial, shape, dtype) is None:
                        config = trial
                        break
                if config is None:
                    continue
                split = shape[1] % config["VEC"] != 0
                offset = OFFSETS[len(found) % 2] if split else 0
                cap = 1 if len(found) % 3 == 0 else None
                found.append(Case(SPEC, config, shape, dtype, cap, offset))
                break
    return found


def test_sub_warp_row_groups_on_the_cpu(tmp_path, monkeypatch) -> None:
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    include = cuda_emulation.cuda_include_dir()
    if include is None or not (include / "cuda_fp16.h").is_file():
        pytest.skip("CUDA headers not found next to nvcc")
    extra = cuda_emulation.HEADER + cuda_emulation.NORM_EXTRA + EXTRA
    monkeypatch.setattr(cuda_emulation, "HEADER", extra)
    found = cases()
    covered = {(c.dtype, c.config["LANES"], c.config["CACHE"]) for c in found}
    assert len(covered) == len(SPEC.dtypes) * len(SUB_WARP) * 3
    for lanes in SUB_WARP:
        mine = [c for c in found if c.config["LANES"] == lanes]
        assert {1, 3, 7, 9, 31} <= {c.shape[1] for c in mine}, lanes
        assert any(c.grid_cap for c in mine) and any(c.offset for c in mine), lanes
        assert len({c.config["VEC"] for c in mine}) >= 2, lanes
    failures = run_cases(found, tmp_path, np.random.default_rng(31))
    assert not failures, "\n".join(failures[:20])


#: Few long rows for STRATEGY 2: 1 row (132 to 528 pieces), 3, 5 and 7 rows (pieces that do not
#: divide the row's vectors), a row length that is whole vectors (2 x 65536), 64 rows of 2 to 8
#: pieces. Lengths are odd or prime elsewhere, so VEC > 1 gives every row a scalar head and tail.
SPLIT_SHAPES = ((1, 20011), (3, 9001), (5, 4100), (2, 65536), (7, 3333), (64, 1031))


def split_cases(seed: int = 0) -> list[Case]:
    """One STRATEGY 2 case per dtype and shape of :data:`SPLIT_SHAPES`: MIN_BLOCKS cycling
    through the space, the first valid VEC of a rotating order (1 last), 32 or 64 threads
    (host threads, seeded);
    split rows shifted by an offset; a few on a grid capped below rows * parts (fewer pieces
    per row, or fewer blocks than rows: the grid-stride loop)."""
    rnd = random.Random(seed)
    found: list[Case] = []
    for dtype in SPEC.dtypes:
        for shape in SPLIT_SHAPES:
            min_blocks = SPEC.params["MIN_BLOCKS"][len(found) % 4]
            config = None
            vecs = (8, 4, 2)[len(found) % 3 :] + (8, 4, 2)[: len(found) % 3] + (1,)
            for vec, block in itertools.product(vecs, rnd.sample([64, 32], 2)):
                trial = {
                    "BLOCK_SIZE": block,
                    "VEC": vec,
                    "STRATEGY": 2,
                    "CACHE": 0,
                    "MIN_BLOCKS": min_blocks,
                    "LANES": 32,
                }
                if SPEC.check(trial, shape, dtype) is None:
                    config = trial
                    break
            assert config is not None, (shape, dtype, min_blocks)
            split = shape[1] % config["VEC"] != 0
            offset = OFFSETS[len(found) % 2] if split else 0
            cap = (None, None, None, 7, 2)[len(found) % 5]
            found.append(Case(SPEC, config, shape, dtype, cap, offset))
    return found


def test_split_rows_on_the_cpu(tmp_path, monkeypatch) -> None:
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    include = cuda_emulation.cuda_include_dir()
    if include is None or not (include / "cuda_fp16.h").is_file():
        pytest.skip("CUDA headers not found next to nvcc")
    extra = cuda_emulation.HEADER + cuda_emulation.NORM_EXTRA + EXTRA
    monkeypatch.setattr(cuda_emulation, "HEADER", extra)
    found = split_cases()
    assert {c.dtype for c in found} == set(SPEC.dtypes)
    assert {c.config["MIN_BLOCKS"] for c in found} == set(SPEC.params["MIN_BLOCKS"])
    assert any(c.offset for c in found) and any(c.shape[1] % c.config["VEC"] for c in found)
    assert any(c.config["VEC"] > 1 and c.shape[1] % c.config["VEC"] == 0 for c in found)
    for case in found:
        steps = SPEC.steps(case.config, case.shape, case.dtype)
        assert [s.kernel for s in steps] == ["softmax_split_stats", "softmax_kernel"]
        parts = split_parts(case.config, case.shape[0])
        assert steps[0].launch.grid[0] == case.shape[0] * parts >= 2 * case.shape[0]
    # Pieces of unequal length: a row's vectors not a multiple of its pieces.
    uneven = [
        c
        for c in found
        if (c.shape[1] // c.config["VEC"]) % split_parts(c.config, c.shape[0]) and not c.grid_cap
    ]
    assert {c.shape[0] for c in uneven} >= {1, 3}
    # A capped grid: fewer pieces per row (1 row on 7 blocks), or fewer blocks than rows.
    assert any(c.grid_cap and c.grid_cap < c.shape[0] for c in found)
    assert any(c.grid_cap and c.grid_cap >= 2 * c.shape[0] for c in found)
    failures = run_cases(found, tmp_path, np.random.default_rng(31))
    assert not failures, "\n".join(failures[:20])
