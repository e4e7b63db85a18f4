"""Above, level or below: Kato's default search against each Kernel Tuner strategy, with error bars.

``benchmarks/search_quality.py`` reports mean fractions of optimum over a few seeds. Whether a
difference between two means is real depends on the spread of the runs: on the convolution
spaces one seed set of 10 differs from the next by about 0.03, on the H200 spaces by 0.001. This
module turns the report's per-seed fractions into a verdict per space and budget:

- the difference of the means (Kato minus the strategy) and its 95% confidence interval by
  Welch's t (the two methods' seeds are independent runs, not pairs: Kernel Tuner's strategies
  draw from their own random streams);
- ``above`` where the interval lies above 0, ``below`` where it lies below 0, ``level`` where it
  contains 0 (including two methods that both reached the optimum in every run).

Against "the best Kernel Tuner strategy" the verdict is taken against every strategy: ``above``
only if above every one, ``below`` if below any one, else ``level``; the strategy with the
highest mean is named. Each interval is at 95% on its own, so over eleven strategies ``below``
errs towards finding Kato below (any one of eleven) and ``above`` towards not finding it above
(every one of eleven): the verdicts lean against Kato, not for it.

Usage (from a report written by ``search_quality.py --out``)::

    python3 benchmarks/verdicts.py data/benchmarks/search_quality.json [--budgets 100]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Two-sided confidence level of the intervals.
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Comparison:
    """Kato's mean minus another method's, with a ``CONFIDENCE`` interval and the verdict."""

    difference: float
    low: float
    high: float
    verdict: str  # above | level | below

    def as_dict(self) -> dict[str, Any]:
        return {
            "difference": self.difference,
            "ci": [self.low, self.high],
            "verdict": self.verdict,
        }


def compare(kato: Sequence[float], other: Sequence[float]) -> Comparison:
    """Welch's two-sample comparison of ``mean(kato) - mean(other)``.

    Raises:
        ValueError: a side has fewer than two runs (no spread to compare with).
    """
    if len(kato) < 2 or len(other) < 2:
        raise ValueError("a comparison needs at least two runs per method")
    from scipy.stats import t as student_t

    diff = statistics.fmean(kato) - statistics.fmean(other)
    va = statistics.variance(kato) / len(kato)
    vb = statistics.variance(other) / len(other)
    se = math.sqrt(va + vb)
    if se == 0.0:  # both constant: equal means are level, different ones are certain
        verdict = "level" if diff == 0.0 else ("above" if diff > 0 else "below")
        return Comparison(diff, diff, diff, verdict)
    # Welch-Satterthwaite degrees of freedom; a constant side contributes no variance.
    dof = (va + vb) ** 2 / (
        (va * va / (len(kato) - 1) if va else 0.0) + (vb * vb / (len(other) - 1) if vb else 0.0)
    )
    half = float(student_t.ppf(0.5 + CONFIDENCE / 2, dof)) * se
    low, high = diff - half, diff + half
    verdict = "above" if low > 0 else "below" if high < 0 else "level"
    return Comparison(diff, low, high, verdict)


def space_verdicts(
    methods: Mapping[str, Mapping[str, Any]], budget: str, kato: str = "kato:forest"
) -> dict[str, Any]:
    """For one space of a report (``files[name]["methods"]``) at ``budget``: Kato's mean, each
    Kernel Tuner strategy's comparison, and the verdict against all of them."""
    ours = methods[kato][budget]["per_seed"]
    against = {
        label.removeprefix("kt:"): compare(ours, per[budget]["per_seed"])
        for label, per in methods.items()
        if label.startswith("kt:")
    }
    if not against:
        raise ValueError("the report has no Kernel Tuner strategy to compare with")
    means = {s: statistics.fmean(methods[f"kt:{s}"][budget]["per_seed"]) for s in against}
    best = max(means, key=means.__getitem__)
    verdicts = {c.verdict for c in against.values()}
    overall = "below" if "below" in verdicts else "above" if verdicts == {"above"} else "level"
    return {
        "kato_mean": statistics.fmean(ours),
        "best_strategy": best,
        "best_mean": means[best],
        "against_best": against[best].as_dict(),
        "against_every": overall,
        "below": sorted(s for s, c in against.items() if c.verdict == "below"),
        "per_strategy": {s: c.as_dict() for s, c in against.items()},
    }


def report_verdicts(report: Mapping[str, Any], budgets: Sequence[str] | None = None) -> dict:
    """``{space: {budget: space_verdicts(...)}}`` for a ``search_quality.py`` report."""
    kato = f"kato:{report.get('kato_default', 'forest')}"
    chosen = [str(b) for b in (budgets or report["budgets"])]
    return {
        name: {b: space_verdicts(entry["methods"], b, kato) for b in chosen}
        for name, entry in report["files"].items()
    }


def print_table(verdicts: Mapping[str, Mapping[str, Any]]) -> None:
    """One row per space and budget; a count of the verdicts per budget after them."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Kato default vs every Kernel Tuner strategy ({CONFIDENCE:.0%} Welch intervals)"
    )
    for head in ("space", "budget", "Kato", "best KT strategy", "Kato - best [CI]", "vs every"):
        table.add_column(head, justify="left" if head in ("space", "best KT strategy") else "right")
    for name, per_budget in verdicts.items():
        for budget, v in per_budget.items():
            c = v["against_best"]
            table.add_row(
                name,
                budget,
                f"{v['kato_mean']:.4f}",
                f"{v['best_strategy']} {v['best_mean']:.4f}",
                f"{c['difference']:+.4f} [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}]",
                v["against_every"] + (f" ({', '.join(v['below'])})" if v["below"] else ""),
            )
    # Piped into a file or a log, rich would fold the rows at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    budgets = sorted({b for per in verdicts.values() for b in per}, key=int)
    for b in budgets:
        counts = {k: 0 for k in ("above", "level", "below")}
        for per in verdicts.values():
            if b in per:
                counts[per[b]["against_every"]] += 1
        console.print(
            f"budget {b}: above every strategy on {counts['above']}, level on {counts['level']},"
            f" below one or more on {counts['below']} of {sum(counts.values())} spaces"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="a search_quality.py --out JSON report")
    ap.add_argument("--budgets", help="comma-separated (default: every budget of the report)")
    ap.add_argument("--out", type=Path, help="write the verdicts as JSON here")
    args = ap.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
        budgets = args.budgets.split(",") if args.budgets else None
        verdicts = report_verdicts(report, budgets)
    except (OSError, ValueError, KeyError) as exc:
        print(f"{args.report}: cannot compare ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print_table(verdicts)
    if args.out:
        args.out.write_text(json.dumps(verdicts, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
