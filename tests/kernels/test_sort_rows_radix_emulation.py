"""The row sort's radix path (``sort`` with ALGO=radix: radix.cu with SEGMENTED) runs on the
CPU (tests/kernels/cuda_emulation.py): every row of a matrix sorted on its own by the radix
kernels launched once for all rows. Awkward shapes (one row; rows of odd and prime lengths just
over MAX_ROW, 8193 and 10007; a short last tile; 3 rows just over one tile; rows of several
histogram chunks), every digit width, ranking method (RANK) and histogram method (HIST: odd
row lengths put every row's start 4, 8 or 12 bytes past a 16-byte boundary, every vector load
bounds-checked), both key types, the stress keys of :func:`kernels.sort.make_keys` (a third
duplicates, +-inf, -0.0/0.0, INT_MIN/INT_MAX), tied rows, the histogram kernel as one block
(its loop over (row, chunk) items), and NaNs of both signs compared bit for bit with the order
the kernels document (the same in the bitonic path); outputs compared exactly.

As in test_sort_radix_emulation.py, blocks run one after another: this checks the row
indexing, the per-row scratch and the prefix arithmetic, not the look-back's concurrency (the
GPU tests' part). Planted bugs in the row indexing fail here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
from cuda_emulation import Case, run_cases
from kato.kernels import get_operator
from kato.kernels.sort import MAX_ROW, SortSpec, radix
from sort_rows_problems import NanBits, TiedRows

# The radix emulation's extra device functions, and its fixture (skips without g++ or the CUDA
# headers).
from test_sort_radix_emulation import radix_emulation  # noqa: F401

SORT = get_operator("sort")

#: Tiles the emulation affords (2048 to 12288 keys): rows of 8193 to 40009 keys are 1 to 20
#: tiles.
TILES = ((128, 16), (256, 8), (128, 24), (256, 12), (128, 20), (512, 16), (1024, 12))
#: (rows, cols): one row with a one-key last tile; a prime row length; 3 rows just over one
#: tile of 8192 (512 x 16); rows of several histogram chunks (16384 keys each); many rows.
SHAPES = ((1, 8193), (2, 10007), (3, 8193), (1, 40009), (7, 8197), (3, 16385))


def radix_config(block: int, items: int, bits: int, rank: str, hist: str) -> dict:
    config = {"BLOCK": block, "ITEMS": items, "ALGO": "radix", "RADIX_BITS": bits}
    config.update(RANK=rank, HIST=hist, WARP_SHFL=0, SMEM_FUSE=1)
    return config


class OneHistBlock(SortSpec):
    """sort whose histogram kernel runs as one block: it loops over every (row, chunk) item,
    clearing and flushing its counts for each."""

    def steps(self, config, shape, dtype):
        out = []
        for step in super().steps(config, shape, dtype):
            if step.kernel == "radix_histogram":
                step = replace(step, launch=replace(step.launch, grid=(1, 1, 1)))
            out.append(step)
        return out


def emulated_cases() -> list[Case]:
    """Every RANK x HIST x RADIX_BITS once, key type, tile and shape rotating (the vector
    histograms with bounds checks); tied rows and the one-block histogram for every HIST; the
    default config at every shape."""
    cases = []
    k = 0
    for rank in radix.RANKS:
        for hist in radix.HISTS:
            for bits in radix.RADIX_BITS:
                block, items = TILES[k % len(TILES)]
                shape = SHAPES[(k // 2) % len(SHAPES)]
                dtype = ("float32", "int32")[(k + k // len(radix.RADIX_BITS)) % 2]
                config = radix_config(block, items, bits, rank, hist)
                cases.append(Case(SORT, config, shape, dtype, bounds=hist != "scalar"))
                k += 1
    for h, hist in enumerate(radix.HISTS):
        config = radix_config(256, 8, 8, radix.RANKS[h], hist)
        for dtype in ("float32", "int32"):
            cases.append(Case(TiedRows(), config, (3, 8193), dtype))
        config = radix_config(128, 16, 4 + 2 * h, "atomic", hist)
        dtype = ("int32", "float32")[h % 2]
        cases.append(Case(OneHistBlock(), config, (5, 16387), dtype, bounds=hist != "scalar"))
    for s, shape in enumerate(SHAPES):
        dtype = ("float32", "int32")[s % 2]
        cases.append(Case(SORT, SORT.default_config(shape, dtype), shape, dtype))
    return cases


def test_radix_rows_on_the_cpu(radix_emulation, tmp_path: Path) -> None:  # noqa: F811
    cases = emulated_cases()
    covered = {(c.config["RANK"], c.config["HIST"], c.config["RADIX_BITS"]) for c in cases}
    assert len(covered) == len(radix.RANKS) * len(radix.HISTS) * len(radix.RADIX_BITS)
    assert {c.shape for c in cases} == set(SHAPES) | {(3, 8193), (5, 16387)}
    assert {c.dtype for c in cases} == {"float32", "int32"}
    # Rows shorter than 2 tiles, rows of many, a last tile of one key, several histogram chunks.
    tiles = {radix.tiles(c.shape[1], c.config) for c in cases}
    assert 1 in tiles and max(tiles) >= 10
    assert any(c.shape[1] % radix.tile(c.config) == 1 for c in cases)
    assert any(c.shape[1] > 2 * radix.SEG_HIST_CHUNK for c in cases)
    for case in cases:
        assert case.spec.check(case.config, case.shape, case.dtype) is None, case
        assert case.shape[1] > MAX_ROW
    failures = run_cases(cases, tmp_path, np.random.default_rng(7), binaries=2)
    assert not failures, "\n".join(failures[:10])


def test_nan_and_signed_zero_order_matches_the_bitonic_rows(
    radix_emulation,  # noqa: F811
    tmp_path: Path,
) -> None:
    """NaNs, infinities, signed zeros and denormals sort bit for bit into the kernels' key
    order on both paths of ``sort``: radix rows (longer than MAX_ROW) and bitonic rows."""
    spec = NanBits()
    cases = [
        Case(spec, radix_config(256, 8, 8, "atomic", "vec4"), (2, 10007), "float32"),
        Case(spec, radix_config(128, 16, 5, "match", "scalar"), (1, 8193), "float32"),
        Case(spec, spec.default_config((3, 1000), "float32"), (3, 1000), "float32"),
        Case(spec, spec.default_config((2, 8192), "float32"), (2, 8192), "float32"),
    ]
    assert [c.config["ALGO"] for c in cases] == ["radix", "radix", "bitonic", "bitonic"]
    failures = run_cases(cases, tmp_path, np.random.default_rng(3), binaries=1)
    assert not failures, "\n".join(failures)


#: Bugs planted in the row indexing of radix.cu's SEGMENTED code, each caught by a small case
#: (3 rows of 2 histogram chunks). Look-back words shared by the rows are not among them: blocks
#: one after another overwrite them before they are read (the GPU tests' part).
PLANTED = {
    "keys of row 0 for every row": ("  keys_in += row * n;\n", ""),
    "histogram of row 0 in the passes": ("  hist += row * (kPasses * kRadix);\n", ""),
    "chunks counted from the row's start": (
        "const long long first = (item - row * chunks) * kSegChunk;",
        "const long long first = 0;",
    ),
    "chunk counted into row 0": (
        "unsigned int* const row_hist = hist + row * kHistBins;",
        "unsigned int* const row_hist = hist;",
    ),
    "every row written to row 0": ("  keys_out += row * n;\n", ""),
    # The vector histograms' per-chunk head, tail and unrolled loop (HIST vec4).
    "chunk tail dropped": (
        "    if (g < m - body_end) hist_count(counts, to_ord(keys[body_end + g], fmask));\n",
        "",
    ),
    "chunk head ignored": (
        "const int head = head_keys < m ? head_keys : m;",
        "const int head = 0;",
    ),
    "chunk loop bound off by one": (
        "for (; v + (kHistVecs - 1) * step < vecs; v += kHistVecs * step) {",
        "for (; v + (kHistVecs - 1) * step <= vecs; v += kHistVecs * step) {",
    ),
}
#: The histogram method each plant needs (the vector ones: HIST vec4, every load checked).
VECTOR_PLANTS = ("chunk tail dropped", "chunk head ignored", "chunk loop bound off by one")


class Planted(SortSpec):
    """sort rendered from radix.cu with one of :data:`PLANTED`."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def template_for(self, config):
        return self.path if config["ALGO"] == "radix" else super().template_for(config)


def test_the_emulation_fails_planted_row_bugs(radix_emulation, tmp_path: Path) -> None:  # noqa: F811
    """Each planted bug fails its case (a wrong output, or an access the emulation traps: a
    misaligned vector load, exit 88; a load outside every array, exit 89); the same cases from
    the real template pass."""
    template = radix.TEMPLATE.read_text()
    cases = []
    for k, (name, (old, new)) in enumerate(PLANTED.items()):
        assert template.count(old) == 1, name
        path = tmp_path / f"planted{k}.cu"
        path.write_text(template.replace(old, new))
        vector = name in VECTOR_PLANTS
        config = radix_config(128, 16, 8, "match", "vec4" if vector else "scalar")
        dtype = ("float32", "int32")[k % 2]
        cases.append(Case(Planted(path), config, (3, 16385), dtype, bounds=vector))
    cases += [replace(c, spec=SORT) for c in cases]
    failures = run_cases(cases, tmp_path, np.random.default_rng(4), binaries=1)
    assert len(failures) == len(PLANTED), failures
    assert all("(3, 16385)" in f for f in failures), failures
    for name, failure in zip(PLANTED, failures, strict=True):
        if name == "chunk head ignored":  # rows 1 and 2 start 4 and 8 bytes past a boundary
            assert "exit 88" in failure and "misaligned 16-byte access" in failure
        elif name == "chunk loop bound off by one":  # row 2's last chunk reads past the keys
            assert "exit 89" in failure or "output 1" in failure, failure
        else:
            assert "output 1" in failure, failure
