"""Every tuning path's per-trial limit on the GPU (issue 31): ``kato.tune_kernel`` measures in
the isolated child, so a kernel that never returns is a ``timeout`` trial and the job ends
done; a config whose one launch takes 0.4 s is timed from as many repeats as fit the limit
instead of timing out; ``kato tune`` on a reduction over a few long rows measures every config
it is given, each no faster than the predicted lower bound. Budget: about 2 minutes on the H200.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from typer.testing import CliRunner

SPIN_MS = 400
TRIAL_TIMEOUT_S = 5.0
ITERATIONS = 7

#: A copy whose ``SPIN_MS`` makes thread 0 hold the GPU that long per launch (on
#: %globaltimer, as tuner/spin_kernel.cu) and whose ``HANG`` never returns (the input is never
#: NaN, as in tests/gpu/faulty_copy.cu).
KERNEL = """
__global__ void spin_copy(float *out, const float *in, int n) {
    int i = blockIdx.x * block_size_x + threadIdx.x;
    if (HANG && i == 0) {  // a volatile read of global memory each time: never optimised out
        const volatile float *spin = in;
        while (spin[0] == spin[0]) { }
    }
    if (SPIN_MS > 0 && i == 0) {
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        do {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        } while (now - start < SPIN_MS * 1000000ull);
    }
    if (i < n) out[i] = in[i];
}
"""


def test_tune_kernel_times_out_a_hung_config_and_fits_slow_ones_into_the_limit(tmp_path):
    import kato

    n = 100_003
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    args = [np.zeros_like(x), x, np.int32(n)]
    params = {"block_size_x": [128, 256], "SPIN_MS": [0, SPIN_MS], "HANG": [0, 1]}
    start = time.monotonic()
    results, env = kato.tune_kernel(
        "spin_copy", KERNEL, n, args, params, restrictions=["HANG * SPIN_MS == 0"],
        answer=[x, None, None], db=f"sqlite:///{tmp_path}/kato.db", name="gpu_spin_copy",
        iterations=ITERATIONS, trial_timeout_s=TRIAL_TIMEOUT_S, quiet=True,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert env["status"] == "done", env
    assert len(results) == 6, results  # the whole valid space (brute force)
    by_kind: dict[str, list[dict]] = {"fast": [], "slow": [], "hung": []}
    for row in results:
        kind = "hung" if row["HANG"] else ("slow" if row["SPIN_MS"] else "fast")
        by_kind[kind].append(row)
    assert [r["status"] for r in by_kind["hung"]] == ["timeout", "timeout"], by_kind["hung"]
    assert all("no result within" in r["error"] for r in by_kind["hung"])
    for row in by_kind["slow"]:  # 13 launches of 0.4 s would not fit 5 s: fewer repeats do
        assert row["status"] == "ok", row
        assert 1 <= len(row["times"]) < ITERATIONS, row["times"]
        assert row["time"] == pytest.approx(SPIN_MS, rel=0.1)
    for row in by_kind["fast"]:
        assert row["status"] == "ok" and len(row["times"]) == ITERATIONS, row
    fastest = min(by_kind["fast"], key=lambda r: r["time"])
    assert env["best_config"] == {k: fastest[k] for k in params}
    print(
        f"\nspin_copy: {elapsed:.1f} s for 6 configs; slow configs timed from "
        f"{[len(r['times']) for r in by_kind['slow']]} repeats at "
        f"{[round(r['time'], 1) for r in by_kind['slow']]} ms"
    )
    assert elapsed < 120, f"took {elapsed:.1f} s"


def test_kato_tune_on_a_few_long_rows_measures_every_config(tmp_path):
    """The issue's case: reduce_sum over 4 rows of 2**26 floats (1 GiB; one block per row for
    most configs), through ``kato tune`` as a user runs it."""
    from kato.db import queries
    from kato.db.session import init_db, session_factory
    from kato.kernels import get_operator
    from kato.service.cli import app
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.trial_cost import launch_lower_bound_s

    from kato.shared.gpus import find_gpu

    rows, cols = 4, 1 << 26
    db = f"sqlite:///{tmp_path}/kato.db"
    start = time.monotonic()
    out = CliRunner().invoke(
        app,
        ["tune", "reduce_sum", "--shape", f"{rows}x{cols}", "--dtype", "float32",
         "--budget", "8", "--db", db, "--json"],
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert result["status"] == "done" and result["measured"] == 8, result
    bound_ms = 1e3 * launch_lower_bound_s(
        get_operator("reduce_sum"), (rows, cols), "float32", find_gpu(describe_device(0).model)
    )
    engine = init_db(db)
    with session_factory(engine)() as session:
        trials = queries.job_trials(session, result["job"])
    engine.dispose()
    statuses = [t.status for t in trials]
    assert "timeout" not in statuses and "crashed" not in statuses, statuses
    ok = [t for t in trials if t.status == "ok"]
    assert ok, [t.error for t in trials]
    assert all(t.time_ms >= bound_ms for t in ok), (bound_ms, [t.time_ms for t in ok])
    print(f"\nreduce_sum {rows}x{cols}: {elapsed:.1f} s; lower bound {bound_ms:.3f} ms")
    for t in sorted(ok, key=lambda t: t.time_ms):
        print(f"  {t.config}: {t.time_ms:.3f} ms from {len(t.times_ms)} repeats")
