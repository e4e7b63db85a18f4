"""The LSD radix sort of ``radix.cu``: its resource model, checks, buffers and launch sequence,
shared by the radix path of ``sort_1d`` and by ``sort_1d_pairs``.

Tunables: ``BLOCK`` (threads of the scatter passes), ``ITEMS`` (keys per thread; a tile is
``T = BLOCK * ITEMS`` keys), ``RADIX_BITS`` (digit width: ``ceil(32 / RADIX_BITS)`` passes),
``RANK`` (how a warp's lanes with equal digits find each other in the ranking: ``"match"``,
``__match_any_sync`` per item, the first value, which renders no macro and so the source of the
space before RANK; ``"ballot"``, one ``__ballot_sync`` per digit bit; ``"atomic"``, ``atomicOr``
into a shared word per warp and digit, two buffers of them in the keys' region), ``HIST`` (how
``radix_histogram`` reads and counts the keys: ``"scalar"``, a 4-byte load per thread per step
into one block histogram, the first value, which renders no macro; ``"vec4"``, 16-byte loads,
four per thread per step, with a scalar head and tail for any pointer and n; ``"vec4_split4"``,
as vec4 into four interleaved copies of the block histogram, lane l counting in copy l % 4).

Scratch (arrays of the problem, after its scalars, in this order): a second key buffer of n
keys (and for pairs a second value buffer), the digit histograms (:data:`HIST_WORDS`), the
per-pass tile counters (:data:`COUNTER_WORDS`) and the two look-back buffers, sized for the
smallest tile the space allows (:func:`status_words`). The first kernel of every call resets
what the others rely on, so nothing is carried between calls.

Rows (``sort``'s ALGO=radix: the template's SEGMENTED macro, keys only): every row of a (rows,
n) matrix is sorted on its own by the same kernels, launched once for all rows (the scatter
passes' tiles numbered row by row, ``rows * tiles`` blocks). The scratch is sized by rows: a
second key buffer of rows * n keys, a histogram block of :data:`HIST_WORDS` per row, the
look-back buffers ``status_words(n, rows)``; an :class:`ArgLayout` with ``rows`` puts the row
count after n.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from kato.kernels import limits
from kato.kernels.spec import Config, Launch, Step

TEMPLATE = Path(__file__).with_name("radix.cu")
KERNELS = ("radix_init", "radix_histogram", "radix_pass")
MAIN_KERNEL = "radix_pass"

#: Digit widths of the space.
RADIX_BITS = (4, 5, 6, 7, 8)
#: Ranking methods of the space, and the RANK macro of each (none for the first: the source
#: from before RANK).
RANKS = ("match", "ballot", "atomic")
RANK_MACRO = {"match": None, "ballot": 1, "atomic": 2}
#: How the histogram kernel reads and counts the keys, and the HIST macro of each (none for the
#: first: the source from before HIST). The vector variants handle any alignment of the keys
#: (a scalar head up to the first 16-byte boundary), so HIST is not a vector width to narrow.
HISTS = ("scalar", "vec4", "vec4_split4")
HIST_MACRO = {"scalar": None, "vec4": 1, "vec4_split4": 2}
#: Copies of the block histogram per HIST.
HIST_COPIES = {"scalar": 1, "vec4": 1, "vec4_split4": 4}
#: The smallest tile the checks allow; the look-back buffers are sized for it, so a tile below
#: it would overrun them (and such tiles only add look-back traffic).
MIN_TILE = 2048
#: Look-back status words hold counts in 30 bits.
MAX_N = 2**30 - 1
#: Histogram words: every pass's digit counts, for the digit width that needs the most.
HIST_WORDS = max(math.ceil(32 / b) << b for b in RADIX_BITS)
#: One tile counter per pass, for the most passes.
COUNTER_WORDS = max(math.ceil(32 / b) for b in RADIX_BITS)
#: Registers besides the ITEMS keys and ranks (and values): fit to ptxas on sm_90 (512 x 16:
#: 64 registers for keys, 88 for pairs).
REGISTER_OVERHEAD = 32
#: Threads and the most blocks of the init and histogram kernels (grid-stride loops beyond).
AUX_BLOCK = 256
MAX_AUX_GRID = 4 * limits.NUM_SMS
#: Keys per histogram-kernel thread below which fewer blocks are launched.
HIST_KEYS_PER_THREAD = 16
#: Keys of one row the rows' histogram kernel counts per block step (radix.cu's kSegChunk; the
#: grid is sized for it, any grid is correct).
SEG_HIST_CHUNK = 16384
#: The most tiles of all rows together: the scatter passes' grid.x and 32-bit tile counters.
MAX_SEG_TILES = 2**31 - 1


def passes(bits: int) -> int:
    return math.ceil(32 / bits)


def tile(config: Config) -> int:
    return config["BLOCK"] * config["ITEMS"]


def tiles(n: int, config: Config) -> int:
    return math.ceil(n / tile(config))


def rank(config: Config) -> str:
    """The config's ranking method (``"match"`` for a config from before RANK)."""
    return config.get("RANK", RANKS[0])


def hist(config: Config) -> str:
    """The config's histogram method (``"scalar"`` for a config from before HIST)."""
    return config.get("HIST", HISTS[0])


def hist_shared_bytes(config: Config) -> int:
    """Static shared memory of ``radix_histogram``: a word per pass and digit, per copy."""
    bits = config["RADIX_BITS"]
    return 4 * (passes(bits) << bits) * HIST_COPIES[hist(config)]


def match_words(config: Config) -> int:
    """Words of RANK="atomic"'s peers words: two buffers of one per warp and digit (0 for the
    other methods)."""
    if rank(config) != "atomic":
        return 0
    return 2 * config["BLOCK"] // 32 * (1 << config["RADIX_BITS"])


def shared_layout(config: Config, pairs: bool) -> dict[str, int]:
    """Word offsets of ``radix_pass``'s dynamic shared memory regions, in order, and
    ``SMEM_WORDS``, their total: the one place the layout is computed. The kernel takes them as
    macros (:func:`defines`; radix.cu asserts that each region holds what it indexes there) and
    the launch gives it ``4 * SMEM_WORDS`` bytes (:func:`shared_bytes`). RANK="atomic" ranks
    with :func:`match_words` words in the keys' region (the keys are stored there only after
    the ranking), which grows where the tile is smaller."""
    radix = 1 << config["RADIX_BITS"]
    t = tile(config)
    regions = (
        ("SMEM_KEYS", max(t, match_words(config))),  # the tile's keys in digit order
        ("SMEM_VALS", t if pairs else 0),  # their values
        ("SMEM_WARP", config["BLOCK"] // 32 * radix),  # a counter per warp and digit
        ("SMEM_COUNT", radix),  # per digit: the tile's count,
        ("SMEM_START", radix),  # its start in the tile,
        ("SMEM_GLOBAL", radix),  # its start in the output,
        ("SMEM_BASE", radix),  # the scatter base
        ("SMEM_TILE", 1),  # the tile id
    )
    layout = {}
    at = 0
    for name, words in regions:
        layout[name] = at
        at += words
    layout["SMEM_WORDS"] = at
    return layout


def shared_bytes(config: Config, pairs: bool) -> int:
    """Dynamic shared memory of ``radix_pass``: the :func:`shared_layout`'s words."""
    return 4 * shared_layout(config, pairs)["SMEM_WORDS"]


def registers(config: Config, pairs: bool) -> int:
    """Registers ``radix_pass`` needs: a key and a rank per item (and a value), plus overhead."""
    return (3 if pairs else 2) * config["ITEMS"] + REGISTER_OVERHEAD


def status_words(n: int, rows: int = 1) -> int:
    """Words of the two look-back buffers: 2 x tiles x 256 at the smallest tile (for every row:
    ``rows`` rows of n keys)."""
    return 2 * rows * math.ceil(n / MIN_TILE) * (1 << max(RADIX_BITS))


def check(config: Config, n: int, pairs: bool, rows: int | None = None) -> str | None:
    """Why a radix config cannot sort n keys (the parameters are known to be in the space), or
    ``rows`` rows of n keys each (tiles of all rows together at most :data:`MAX_SEG_TILES`)."""
    block, min_blocks = config["BLOCK"], config.get("MIN_BLOCKS", 0)
    if n > MAX_N:
        return f"the radix sort takes at most 2**30 - 1 keys (30-bit look-back counts), n={n}"
    if reason := limits.resident_threads_error(min_blocks, block):
        return reason
    if tile(config) < MIN_TILE:
        return f"BLOCK x ITEMS = {tile(config)} keys per tile; the radix sort needs {MIN_TILE}"
    if rows is not None and rows * tiles(n, config) > MAX_SEG_TILES:
        return (
            f"{rows} rows x {tiles(n, config)} tiles of {tile(config)} keys: over "
            f"{MAX_SEG_TILES} blocks of one launch (grid.x)"
        )
    cap = limits.launch_bounds_register_cap(block, min_blocks)
    if registers(config, pairs) > cap:
        return (
            f"ITEMS={config['ITEMS']} needs about {registers(config, pairs)} registers per "
            f"thread; the launch bounds of {block} threads allow {cap}: it would spill"
        )
    if shared_bytes(config, pairs) > limits.MAX_SHARED_PER_BLOCK:
        return f"{shared_bytes(config, pairs)} bytes of shared memory per block; at most 227 KiB"
    return None


def defines(config: Config, pairs: bool, segmented: bool = False) -> dict[str, object]:
    """The tunables and the shared memory layout the launch is sized for (RANK and HIST only
    where they are not the first method: a config from before them renders what it rendered
    then; SEGMENTED only for rows)."""
    macros: dict[str, object] = {
        "BLOCK": config["BLOCK"],
        "ITEMS": config["ITEMS"],
        "RADIX_BITS": config["RADIX_BITS"],
        "PAIRS": int(pairs),
    }
    if segmented:
        macros["SEGMENTED"] = 1
    code = RANK_MACRO[rank(config)]
    if code is not None:
        macros["RANK"] = code
    code = HIST_MACRO[hist(config)]
    if code is not None:
        macros["HIST"] = code
    macros.update(shared_layout(config, pairs))
    return macros


def pass_launch(config: Config, n: int, pairs: bool, rows: int = 1) -> Launch:
    """One block per tile (of every row): the look-back needs every tile id taken exactly
    once."""
    grid = rows * tiles(n, config)
    return Launch((grid, 1, 1), (config["BLOCK"], 1, 1), shared_bytes(config, pairs))


def steps(
    config: Config, n: int, layout: ArgLayout, key_float: bool, rows: int | None = None
) -> list[Step]:
    """Init, histogram, then one scatter pass per digit, ping-ponging so the last writes the
    output: pass p writes the output when ``passes - 1 - p`` is even, the scratch otherwise.
    With ``rows`` (a layout with rows): every row of n keys sorted on its own, the kernels
    taking the row count after n, the histogram kernel's grid one block per
    :data:`SEG_HIST_CHUNK` keys of a row (at most :data:`MAX_AUX_GRID`)."""
    if rows is not None:
        return _row_steps(config, n, rows, layout, key_float)
    count = passes(config["RADIX_BITS"])
    key = layout.scalar(int(key_float))
    status = status_words(n)
    init_grid = max(1, min(math.ceil(status // 2 / (4 * AUX_BLOCK)), MAX_AUX_GRID))
    hist_grid = max(1, min(math.ceil(n / (HIST_KEYS_PER_THREAD * AUX_BLOCK)), MAX_AUX_GRID))
    aux = (AUX_BLOCK, 1, 1)
    out = [
        Step(
            "radix_init",
            Launch((init_grid, 1, 1), aux, 0),
            (layout.hist, layout.counters, layout.status, layout.n),
        ),
        Step(
            "radix_histogram",
            Launch((hist_grid, 1, 1), aux, 0),
            (layout.keys_in, layout.n, layout.hist, key),
        ),
    ]
    launch = pass_launch(config, n, layout.pairs)
    keys_src, vals_src = layout.keys_in, layout.vals_in
    for p in range(count):
        to_output = (count - 1 - p) % 2 == 0
        keys_dst = layout.keys_out if to_output else layout.keys_tmp
        args: tuple[int, ...] = (keys_src, keys_dst)
        if layout.pairs:
            vals_dst = layout.vals_out if to_output else layout.vals_tmp
            args += (vals_src, vals_dst)
            vals_src = vals_dst
        args += (layout.n, layout.hist, layout.counters, layout.status, layout.scalar(p), key)
        out.append(Step("radix_pass", launch, args))
        keys_src = keys_dst
    return out


def _row_steps(config: Config, n: int, rows: int, layout: ArgLayout, key_float: bool) -> list[Step]:
    """:func:`steps` for ``rows`` rows of n keys (keys only)."""
    assert layout.rows >= 0 and not layout.pairs, "rows of keys need ArgLayout(rows=True)"
    count = passes(config["RADIX_BITS"])
    key = layout.scalar(int(key_float))
    zeroed = max(status_words(n, rows) // 2, rows * HIST_WORDS)
    init_grid = max(1, min(math.ceil(zeroed / (4 * AUX_BLOCK)), MAX_AUX_GRID))
    hist_grid = max(1, min(rows * math.ceil(n / SEG_HIST_CHUNK), MAX_AUX_GRID))
    aux = (AUX_BLOCK, 1, 1)
    out = [
        Step(
            "radix_init",
            Launch((init_grid, 1, 1), aux, 0),
            (layout.hist, layout.counters, layout.status, layout.n, layout.rows),
        ),
        Step(
            "radix_histogram",
            Launch((hist_grid, 1, 1), aux, 0),
            (layout.keys_in, layout.n, layout.rows, layout.hist, key),
        ),
    ]
    launch = pass_launch(config, n, pairs=False, rows=rows)
    keys_src = layout.keys_in
    for p in range(count):
        keys_dst = layout.keys_out if (count - 1 - p) % 2 == 0 else layout.keys_tmp
        args = (keys_src, keys_dst, layout.n, layout.rows, layout.hist, layout.counters)
        args += (layout.status, layout.scalar(p), key)
        out.append(Step("radix_pass", launch, args))
        keys_src = keys_dst
    return out


class ArgLayout:
    """Indices of the radix kernels' arguments in a problem's args: the operator's own arrays
    and n first (``keys_in, [vals_in,] keys_out, [vals_out,] n``; with ``rows``, keys only:
    ``keys_in, keys_out, n, rows``, both int64), the int32 scalars 0..63, then the scratch
    arrays of :func:`scratch`."""

    def __init__(self, pairs: bool, rows: bool = False) -> None:
        assert not (pairs and rows), "rows of keys only"
        self.pairs = pairs
        self.keys_in = 0
        self.rows = -1
        if pairs:
            self.vals_in, self.keys_out, self.vals_out, self.n = 1, 2, 3, 4
        else:
            self.vals_in = self.vals_out = -1
            self.keys_out, self.n = 1, 2
        if rows:
            self.rows = self.n + 1
        self.first_scalar = max(self.n, self.rows) + 1
        after = self.first_scalar + 64
        self.keys_tmp = after
        self.vals_tmp = after + 1 if pairs else -1
        self.hist = after + (2 if pairs else 1)
        self.counters = self.hist + 1
        self.status = self.hist + 2

    def scalar(self, value: int) -> int:
        assert 0 <= value < 64, value
        return self.first_scalar + value


def scratch(n: int, dtype: str, pairs: bool, rows: int = 1) -> list[np.ndarray]:
    """The scratch arrays in :class:`ArgLayout` order (for ``rows`` rows of n keys: rows x the
    keys, histograms and look-back words). The second key (and value) buffer is poisoned; the
    histograms hold garbage that radix_init must clear; the counters and status words start at
    zero (radix_init clears them again on every call)."""
    key_type = np.float32 if dtype == "float32" else np.int32
    arrays = [np.full(rows * n, 0x7FC00001, np.uint32).view(key_type)]
    if pairs:
        arrays.append(np.full(rows * n, -777, np.int32))
    arrays.append(np.full(rows * HIST_WORDS, 0xDEADBEEF, np.uint32))
    arrays.append(np.zeros(COUNTER_WORDS, np.uint32))
    arrays.append(np.zeros(status_words(n, rows), np.uint32))
    return arrays


def scratch_bytes(n: int, pairs: bool, rows: int = 1) -> int:
    keys = rows * n * (2 if pairs else 1)
    return 4 * (keys + rows * HIST_WORDS + COUNTER_WORDS + status_words(n, rows))


def ordered_keys(x: np.ndarray) -> np.ndarray:
    """The kernels' unsigned key order: float bits with all bits of negatives flipped and the
    sign bit of the rest (-0.0 before +0.0), int bits with the sign bit flipped."""
    bits = x.view(np.uint32)
    if x.dtype.kind == "f":
        return bits ^ np.where(bits >> 31 != 0, np.uint32(0xFFFFFFFF), np.uint32(0x80000000))
    return bits ^ np.uint32(0x80000000)


def stable_order(x: np.ndarray) -> np.ndarray:
    """The permutation the radix sort applies: a stable argsort by :func:`ordered_keys`."""
    return np.argsort(ordered_keys(x), kind="stable")
