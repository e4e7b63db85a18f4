"""kernels.parallel: problems filled in fixed chunks on several threads are the same problems
whatever the number of threads, every row is filled once, and a chunk's error is raised."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import get_operator, parallel


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of a few rows, so that small problems have many (with starts not a multiple of
    4: reduce_sum's row pattern runs across them)."""
    monkeypatch.setattr(parallel, "CHUNK_ELEMENTS", 3 * 64)


def test_row_chunks_cover_every_row_once_in_whole_rows() -> None:
    for rows, row_elements in [(1, 1), (10, 1 << 22), (1000, 4096), ((1 << 28) + 5, 1)]:
        chunks = parallel.row_chunks(rows, row_elements)
        assert chunks[0].start == 0 and chunks[-1].stop == rows
        assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:], strict=False))
        assert all(c.stop > c.start for c in chunks)
    assert len(parallel.row_chunks(1 << 28, 1)) == 64
    assert parallel.row_chunks(0, 5) == []


@pytest.mark.parametrize(
    ("operator", "shape", "dtype"),
    [
        ("relu", [1000], "float16"),
        ("softmax", [37, 64], "float32"),
        ("layernorm", [37, 64], "bfloat16"),
        ("reduce_sum", [37, 64], "float16"),
        ("reduce_sum_all", [1000], "bfloat16"),
    ],
)
def test_problems_do_not_depend_on_the_thread_count(
    operator: str, shape: list[int], dtype: str, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = get_operator(operator)
    made = []
    for threads in (1, 4):
        monkeypatch.setattr(parallel, "threads", lambda threads=threads: threads)
        made.append(spec.make_problem(shape, dtype, np.random.default_rng(7)))
    one, four = made
    for a, b in zip(one.args + one.references, four.args + four.references, strict=True):
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_each_chunk_draws_from_its_own_generator(small_chunks: None) -> None:
    x = get_operator("relu").make_problem([1000], "float32", np.random.default_rng(0)).args[0]
    chunks = [x[c] for c in parallel.row_chunks(1000, 1)]
    assert len(chunks) == 6
    assert all(not np.array_equal(chunks[0], c) for c in chunks[1:4])


def test_reduce_sum_rows_follow_the_pattern_across_chunks(small_chunks: None) -> None:
    """Rows 3 (mod 4) of the whole problem are N(0, 1), the others +-U(0.5, 1.5), whatever
    row a chunk starts at (chunks of 3 rows here); the references are the rows' float64 sums."""
    problem = get_operator("reduce_sum").make_problem([41, 64], "float32", np.random.default_rng(3))
    x = problem.args[0].astype(np.float64)
    magnitude = np.abs(x)
    uniform = (magnitude >= 0.5) & (magnitude <= 1.5)
    for row in range(41):
        if row % 4 == 3:
            assert not uniform[row].all(), row
        else:
            assert uniform[row].all(), row
    np.testing.assert_array_equal(problem.references[0], x.sum(axis=1))
    assert np.isnan(problem.args[1]).all()


def test_a_chunk_error_is_raised() -> None:
    def fill(chunk: slice, gen: np.random.Generator) -> None:
        if chunk.start > 0:
            raise ValueError(f"chunk at {chunk.start}")

    with pytest.raises(ValueError, match="chunk at"):
        parallel.fill_rows(np.random.default_rng(0), 3 << 22, 1, fill)


def test_reduce_sum_all_sentinels_and_sums_across_chunks(small_chunks: None) -> None:
    """The sentinels (both ends and random positions) land in whichever chunk holds them, and
    the reference is the float64 sum of x as stored."""
    from kato.kernels.reduce_sum_all import SENTINELS, sentinel_magnitude

    n = 1000
    problem = get_operator("reduce_sum_all").make_problem([n], "float32", np.random.default_rng(5))
    x = problem.args[0].astype(np.float64)
    big = np.flatnonzero(np.abs(x) == np.float32(sentinel_magnitude(n, "float32")))
    assert set(range(SENTINELS)) | set(range(n - SENTINELS, n)) <= set(big)
    assert len(big) > 2 * SENTINELS  # and some inside
    assert np.array_equal(np.sign(x[big]), np.where(np.arange(big.size) % 2 == 0, 1.0, -1.0))
    assert problem.references[0][0] == pytest.approx(x.sum(), rel=1e-12)


def test_the_operators_that_fill_in_chunks_version_this_module() -> None:
    """Changing how problems are filled changes their inputs: it must change the versions of the
    operators that use it (and reduce_sum's covers the reduce_sum_all helpers it imports)."""
    import sys

    from kato.kernels.spec import _kernel_helpers

    def helpers(name: str) -> set[str]:
        module = sys.modules[type(get_operator(name)).__module__]
        return {m.__name__ for m in _kernel_helpers(module)}

    for name in ("relu", "softmax", "layernorm", "reduce_sum", "reduce_sum_all"):
        assert "kato.kernels.parallel" in helpers(name), name
    assert "kato.kernels.reduce_sum_all" in helpers("reduce_sum")
    assert helpers("matmul") == {"kato.kernels.limits"}


def test_batchnorm_problems_and_references_do_not_depend_on_the_thread_count(
    small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = get_operator("batchnorm_stats")
    made = []
    for threads in (1, 3):
        monkeypatch.setattr(parallel, "threads", lambda threads=threads: threads)
        made.append(spec.make_problem([5, 6, 3, 4], "float16", np.random.default_rng(2)))
    one, three = (m.args[:1] + m.references for m in made)
    for a, b in zip(one, three, strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    x = made[0].args[0].astype(np.float64)
    np.testing.assert_allclose(made[0].references[0], x.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(made[0].references[1], x.var(axis=(0, 2, 3)), rtol=1e-9)


def test_run_chunks_holds_temporaries_within_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls of 1 GiB of temporaries each run two at a time under a 2 GiB cap."""
    import threading
    import time

    monkeypatch.setattr(parallel, "threads", lambda: 8)
    running, peak, lock = [0], [0], threading.Lock()

    def work(i: int) -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1

    parallel.run_chunks(work, 8, chunk_bytes=1 << 30)
    assert peak[0] == 2
