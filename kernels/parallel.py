"""Building large problems on every core of the host.

A tuning job starts by making its problem (random inputs and float64 references,
:meth:`kernels.spec.OperatorSpec.make_problem`), and at 2^28 elements one NumPy pass after
another on one core kept the GPU waiting for seconds (the figures: docs/design.md, "Problems on
every core"). :func:`fill_rows` splits the rows of a problem into fixed chunks, gives each chunk a
random generator of its own (spawned from the job's) and fills the chunks in a thread pool:
NumPy releases the GIL in its generators, casts and ufuncs, so the chunks run in parallel, and
each chunk's temporaries stay small.

The result depends only on the caller's generator and the problem's size, never on the number
of threads or on which thread ran a chunk: the chunk boundaries are fixed by the size, and each
chunk reads only its own generator.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: Elements per chunk (rows are never split): large enough that the per-chunk overhead (a
#: generator, a task) is negligible, small enough that a chunk's float64 temporaries (32 MiB)
#: stay in the caches' neighbourhood and that 2^28 elements make 64 chunks to balance.
CHUNK_ELEMENTS = 1 << 22
#: Threads at most: beyond this the passes are bound by memory bandwidth.
MAX_THREADS = 16
#: Temporaries all threads together may hold (:func:`run_chunks`' ``chunk_bytes``): a chunk
#: that cannot be split (one channel of a huge batchnorm) must not be held 16 times at once.
MAX_TEMPORARY_BYTES = 2 << 30


def threads() -> int:
    """The threads :func:`fill_rows` uses: the CPUs this process may run on, at most
    :data:`MAX_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def row_chunks(rows: int, row_elements: int) -> list[slice]:
    """The fixed chunks of ``rows`` rows of ``row_elements`` elements each: whole rows, about
    :data:`CHUNK_ELEMENTS` elements per chunk, in order, covering every row once."""
    per = max(1, CHUNK_ELEMENTS // max(1, row_elements))
    return [slice(lo, min(rows, lo + per)) for lo in range(0, rows, per)]


def fill_rows(
    rng: np.random.Generator,
    rows: int,
    row_elements: int,
    fill: Callable[[slice, np.random.Generator], None],
) -> None:
    """Call ``fill(chunk, generator)`` for every chunk of :func:`row_chunks`, in a thread pool;
    each chunk gets its own generator, spawned from ``rng`` in chunk order (``rng``'s own
    stream is not drawn from).

    ``fill`` must write only its chunk's rows of the arrays it fills and draw only from the
    generator it is given. An exception in any chunk is raised here (after the others ran).
    """
    chunks = row_chunks(rows, row_elements)
    generators = rng.spawn(len(chunks))
    run_chunks(lambda i: fill(chunks[i], generators[i]), len(chunks))


def run_chunks(work: Callable[[int], None], count: int, *, chunk_bytes: int = 0) -> None:
    """Call ``work(i)`` for ``i`` in ``range(count)`` in a thread pool of :func:`threads`
    threads (in this thread when one suffices), fewer where ``chunk_bytes`` (the temporaries
    one call holds) times the threads would pass :data:`MAX_TEMPORARY_BYTES`. Each call must
    touch only its own part of the arrays it writes. An exception in any call is raised here
    (after the others ran)."""
    workers = min(threads(), count, max(1, MAX_TEMPORARY_BYTES // max(1, chunk_bytes)))
    if workers <= 1:
        for i in range(count):
            work(i)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="kato-problem") as pool:
        for future in [pool.submit(work, i) for i in range(count)]:
            future.result()
