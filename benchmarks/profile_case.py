"""Launch one benchmark case's stored winner a few times, for a profiler to capture.

    ncu --kernel-name regex:relu --launch-count 2 --section SpeedOfLight \
        python3 benchmarks/profile_case.py --db sqlite:///kato.db --case relu:268435456:float32

The config is the one ``benchmarks/operators.py`` times for the case (exact or nearest stored
winner valid for the shape, else the operator's default), or ``--config`` (JSON): one config
profiled at two shapes shows what the shape alone costs (e.g. transpose at 8191x8193 and
8192x8192). The kernels run through Kato's pycuda
backend, verification first, then a few timed launches; filter the profiler on the operator's
kernel names (``spec.kernel_names``) so that the verifier is left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True, help="SQLAlchemy URL of the results database")
    ap.add_argument("--case", required=True, help="operator:shape:dtype, shape as 8192x32768")
    ap.add_argument("--repeats", type=int, default=2, help="timed batches after verification")
    ap.add_argument("--config", type=json.loads, help="this config (JSON) instead of the winner")
    args = ap.parse_args()

    from kato.db.session import init_db, session_factory
    from kato.kernels import get_operator
    from kato.tuner.backends.pycuda import PyCudaBackend, describe_device

    from benchmarks.operators import lookup

    operator, shape_text, dtype = args.case.split(":")
    shape = tuple(int(s) for s in shape_text.split("x"))
    spec = get_operator(operator)
    sessions = session_factory(init_db(args.db))
    if args.config is not None:
        config, source = dict(args.config), "given"
        missing, unknown = set(spec.params) - set(config), set(config) - set(spec.params)
        problem = (
            f"missing {sorted(missing)}, unknown {sorted(unknown)}"
            if missing or unknown
            else spec.check(config, shape, dtype)
        )
        if problem is not None:
            raise SystemExit(f"--config: {problem}")
    else:
        best, source = lookup(sessions, spec, shape, dtype, describe_device(0).model)
        config = best.config if best is not None else spec.default_config(shape, dtype)
    backend = PyCudaBackend(spec, shape, dtype, repeats=args.repeats, warmup=0)
    try:
        result = backend.evaluate(config)
    finally:
        backend.close()
    print(
        json.dumps(
            {
                "case": args.case,
                "source": source,
                "config": config,
                "status": result.status.value,
                "time_ms": result.time_ms,
            }
        )
    )


if __name__ == "__main__":
    main()
