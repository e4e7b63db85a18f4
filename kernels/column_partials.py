"""What the norm backward operators share (``rmsnorm_backward``: dweight; ``layernorm_backward``:
dweight and dbias): dx row by row as every :mod:`kernels.rowwise` operator, and the column sums
in two stages (kernels/common/kato_partials.cuh). Every block of stage 1 sums the rows it
processes into one float32 partial row of ``sums * cols`` floats (``sums``: the column sums per
column, 1 or 2), where its ``DW_ACC`` says (0: each thread's own columns in registers; 1: a
shared row per row group; 2: the partial row itself in global memory); stage 2 adds the partial
rows in a fixed order. Each operator's module lists its parameters and states its constraints;
this module holds the model they have in common.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kato.kernels import limits, rowwise
from kato.kernels.spec import DTYPES, Config, Launch, Step

#: The largest SPLIT of the spaces: the partials buffer holds MAX_SPLIT * NUM_SMS rows at most.
MAX_SPLIT = 8


def dw_shared_bytes(config: Config, cols: int, sums: int) -> int:
    """Dynamic shared memory of the column sums: ``sums * cols`` floats per row group with
    DW_ACC=1, and with DW_ACC=0 where several row groups share a block (summed there)."""
    groups = rowwise.rows_per_block(config)
    if config["DW_ACC"] == 1 or (config["DW_ACC"] == 0 and groups > 1):
        return groups * sums * cols * 4
    return 0


def accumulator_registers(config: Config, cols: int, sums: int) -> int:
    """DW_ACC=0's registers per thread: ITEMS vectors of VEC float accumulators per column sum,
    and with CACHE 0/1 the x and dy vectors of its fully unrolled pass as well (ptxas issues all
    of their loads first)."""
    if config["DW_ACC"] != 0:
        return 0
    elements = rowwise.items_per_thread(config, cols) * config["VEC"]
    return sums * elements if config["CACHE"] == 2 else (sums + 2) * elements


def wb_regs(config: Config, cols: int, itemsize: int, sums: int, overhead: int) -> int:
    """1 if DW_ACC=0 keeps the weight in registers too: caches, accumulators and the weight's
    ITEMS vectors within the register cap (``overhead`` to spare)."""
    if config["DW_ACC"] != 0:
        return 0
    vector = rowwise.vector_registers(config, cols, itemsize)
    need = accumulator_registers(config, cols, sums) + vector + overhead
    need += rowwise.ITEM_REGISTERS * rowwise.items_per_thread(config, cols)
    if config["CACHE"] == 2:
        need += 2 * vector
    return int(need <= rowwise.register_cap(config))


def stage1_grid(config: Config, rows: int) -> int:
    """Stage-1 blocks (and partial rows): one per row group of rows, at most SPLIT per SM."""
    groups = math.ceil(rows / rowwise.rows_per_block(config))
    return min(groups, config["SPLIT"] * limits.NUM_SMS)


def partial_rows(rows: int) -> int:
    """Rows of the partials buffer: the most stage-1 blocks any config launches."""
    return min(rows, MAX_SPLIT * limits.NUM_SMS)


class ColumnPartialsSpec(rowwise.RowwiseSpec):
    """A norm backward: :class:`rowwise.RowwiseSpec` with ``DW_ACC``, ``SPLIT`` and
    ``REDUCE_LANES`` (subclasses list them in :attr:`params`), :attr:`sums` column sums per
    column and the two kernels of :attr:`kernel_names` (stage 1, then the reduce)."""

    #: Column sums per column: the partial row holds ``sums * cols`` floats.
    sums: int
    #: Registers beside the caches and accumulators with the weight in registers (WB_REGS).
    wb_register_overhead: int

    def extra_registers(self, config: Config, cols: int, itemsize: int) -> int:
        return accumulator_registers(config, cols, self.sums)

    def dynamic_shared_bytes(self, config: Config, cols: int, itemsize: int) -> int:
        cache = rowwise.row_cache_bytes(config, cols, itemsize, self.cached_arrays)
        return cache + dw_shared_bytes(config, cols, self.sums)

    def check_partials(self, config: Config, cols: int) -> str | None:
        """DW_ACC=0 needs ``cols % VEC == 0`` (a thread keeps the same columns in every row
        only if every row has the same head); DW_ACC=2 one row group per block."""
        if config["DW_ACC"] == 0 and cols % config["VEC"] != 0:
            return (
                f"DW_ACC=0 needs cols % VEC == 0 (cols={cols}, VEC={config['VEC']}): rows would "
                "start at different offsets of a vector and a thread's columns would move"
            )
        if config["DW_ACC"] == 2 and config["ROW_THREADS"] != 0:
            return "DW_ACC=2 sums into the block's partial row: it needs ROW_THREADS=0"
        return None

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """:meth:`RowwiseSpec.base_default` with the column sums in registers where
        ``cols % VEC == 0``, else in shared memory, else (rows too long for it) in global
        memory; 2 blocks per SM of partials, 16 reduce lanes."""
        _, cols = self.validate(shape, dtype)
        vec = self.widest_vec(cols, dtype)
        for dw_acc in (0, 1, 2) if cols % vec == 0 else (1, 2):
            try:
                return self.base_default(
                    shape, dtype, {"DW_ACC": dw_acc, "SPLIT": 2, "REDUCE_LANES": 16}
                )
            except AssertionError:
                continue
        raise AssertionError(f"no default {self.name} config for {tuple(shape)} {dtype}")

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """The row-wise macros with ITEMS also for DW_ACC=0 (its accumulators), DW_ACC and
        WB_REGS (:func:`wb_regs`); SPLIT and REDUCE_LANES are launch geometry only."""
        macros = super().defines(config, shape, dtype)
        cols = shape[1]
        if config["DW_ACC"] == 0:
            macros["ITEMS"] = rowwise.items_per_thread(config, cols)
        macros["DW_ACC"] = config["DW_ACC"]
        itemsize = DTYPES[dtype][2]
        macros["WB_REGS"] = wb_regs(config, cols, itemsize, self.sums, self.wb_register_overhead)
        return macros

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """Stage 1: :func:`stage1_grid` blocks of BLOCK_SIZE threads, dynamic shared memory of
        CACHE=1's rows and the column sums' rows (:meth:`dynamic_shared_bytes`)."""
        rows, cols = shape
        shared = self.dynamic_shared_bytes(config, cols, DTYPES[dtype][2])
        return Launch(
            grid=(stage1_grid(config, rows), 1, 1),
            block=(config["BLOCK_SIZE"], 1, 1),
            shared_bytes=shared,
        )

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """Stage 1, then the reduce: ``ceil(sums * cols / 32)`` blocks of (32, REDUCE_LANES)."""
        cols = shape[1]
        reduce = Launch(
            grid=(min(math.ceil(self.sums * cols / 32), limits.MAX_GRID_X), 1, 1),
            block=(32, config["REDUCE_LANES"], 1),
        )
        stage1, stage2 = self.kernel_names
        return [Step(stage1, self.launch(config, shape, dtype)), Step(stage2, reduce)]

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        """What :meth:`bytes_moved` counts, plus the partials buffer and nparts."""
        rows, cols = shape
        return self.bytes_moved(shape, dtype) + 4 * self.sums * partial_rows(rows) * cols + 4
