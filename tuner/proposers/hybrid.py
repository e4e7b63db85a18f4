"""``hybrid``: TPE plus a greedy local search around the best configs so far."""

from __future__ import annotations

from kato.tuner.proposers.base import History
from kato.tuner.proposers.optuna_samplers import TpeProposer
from kato.tuner.space import Config


class HybridProposer(TpeProposer):
    """Half of the proposals after the start-up phase (``local_after`` results) explore the
    neighbourhood of one of the three best configs so far, enqueued in TPE's study; the rest
    come from TPE. Its draws come from the context's ``rng``."""

    name = "hybrid"
    local_after = 15

    def _neighbours(self, config: Config) -> list[Config]:
        """Configs one step away: one ordered parameter moved to an adjacent value, or one
        categorical parameter changed."""
        out = []
        for name, vals in self.encoding.values.items():
            i = vals.index(config[name])
            steps = (i - 1, i + 1) if self.encoding.ordered[name] else range(len(vals))
            for j in steps:
                if 0 <= j < len(vals) and j != i:
                    out.append({**config, name: vals[j]})
        return out

    def local_proposal(self, history: History) -> Config | None:
        results, rng, space = history.results, self.context.rng, self.context.space
        ok = sorted((r for r in results.values() if r.time_ms is not None), key=lambda r: r.time_ms)  # type: ignore[arg-type,return-value]
        if len(results) < self.local_after or rng.random() < 0.5:
            return None
        for rank, incumbent in enumerate(ok[:3]):
            if rank and rng.random() < 0.5:
                continue
            fresh = [
                c
                for c in self._neighbours(incumbent.config)
                if space.is_valid(c) and space.key(c) not in results
            ]
            if fresh:
                return rng.choice(fresh)
        return None
