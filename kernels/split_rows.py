"""Few long rows split over blocks (issue 31): what softmax's ``STRATEGY=2`` and layernorm's
``GROUP_ROWS=0`` share. Each row is cut into pieces, one block each, on a grid of one wave of
the blocks the launch bounds keep resident (``max(MIN_BLOCKS, 1)`` per SM); two launches, the
first writing each piece's partials to the module, the second merging its row's and writing
the piece. Pieces are streamed (``CACHE=0``)."""

from __future__ import annotations

from kato.kernels import limits
from kato.kernels.spec import Config


def pieces_per_row(config: Config, rows: int) -> int:
    """``(max(MIN_BLOCKS, 1) * 132) // rows`` (floor: the grid never exceeds the one wave the
    launch bounds promise)."""
    return max(config["MIN_BLOCKS"], 1) * limits.NUM_SMS // rows


def split_error(mode: str, config: Config, rows: int, cols: int) -> str | None:
    """Why a split config (``mode`` names its switch in the messages, "STRATEGY=2") makes no
    sense at rows x cols, or None: CACHE other than 0 (the two launches share nothing but the
    partials); launch bounds that leave fewer than 64 registers a thread (ptxas spills the
    streaming step there: 48 to 368 bytes at every VEC and dtype on sm_90); fewer than 2 pieces
    per row (a block per row runs the same blocks in one launch); pieces of fewer than
    ``BLOCK_SIZE`` vectors (threads of every block would idle)."""
    if config["CACHE"] != 0:
        return f"{mode} streams its pieces: CACHE=0, got CACHE={config['CACHE']}"
    cap = limits.launch_bounds_register_cap(config["BLOCK_SIZE"], config["MIN_BLOCKS"])
    if cap < 64:
        return (
            f"{mode} under launch bounds of {cap} registers a thread "
            f"(BLOCK_SIZE={config['BLOCK_SIZE']}, MIN_BLOCKS={config['MIN_BLOCKS']}) spills"
        )
    parts = pieces_per_row(config, rows)
    if parts < 2:
        blocks = max(config["MIN_BLOCKS"], 1) * limits.NUM_SMS
        return (
            f"{mode} with MIN_BLOCKS={config['MIN_BLOCKS']} sizes the grid for {blocks} "
            f"blocks: {rows} rows would not be split"
        )
    vec = config["VEC"]
    # The aligned body of a row whose head takes up to VEC - 1 elements.
    nvec = cols // vec if cols % vec == 0 else (cols - vec + 1) // vec
    if nvec // parts < config["BLOCK_SIZE"]:
        return (
            f"{mode} cuts rows of {nvec} vectors into {parts} pieces of "
            f"{nvec // parts} or more, fewer than BLOCK_SIZE={config['BLOCK_SIZE']} threads"
        )
    return None
