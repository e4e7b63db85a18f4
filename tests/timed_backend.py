"""A replay backend whose trials take wall time as a GPU's do, for the per-trial limit tests
(importable as ``timed_backend``; a measuring child finds it on the inherited sys.path).

Each evaluation of a recorded config sleeps ``launch_s`` per launch: two verification runs,
then timing repeats (up to ``repeats``), stopping where the next would end past the deadline of
the trial's limit (:class:`tuner.trial_cost.TrialDeadline`, as the PyCUDA backend does), at
least one; its ``times_ms`` hold the recorded time once per repeat. ``launch_lower_bound_s``
is ``predicted_s``: the cost prediction a real backend makes from the operator and the GPU
catalog. Configs whose key is in ``hang`` sleep forever (a deadlocked kernel).

Options come from the :class:`BackendSpec` (``options``) or, for a spec built by ``kato tune
--backend timed_backend:make``, from the JSON object in ``KATO_TEST_TIMED_BACKEND`` (the child
inherits the environment): ``{"launch_s": 0.2, "predicted_s": 0.1, "repeats": 5, "hang":
["64,8,1,2,2"]}``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import Any

from kato.tuner.backends.base import Backend, TrialResult
from kato.tuner.backends.isolated import BackendSpec
from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.trial_cost import TrialDeadline

ENV = "KATO_TEST_TIMED_BACKEND"
VERIFY_LAUNCHES = 2


class TimedReplay(ReplayBackend):
    def __init__(
        self,
        replay_file: str,
        *,
        launch_s: float = 0.0,
        predicted_s: float | None = None,
        repeats: int = 5,
        hang: Iterable[str] = (),
    ):
        super().__init__(replay_file)
        self.launch_s, self.predicted_s, self.repeats = launch_s, predicted_s, repeats
        self.hang = set(hang)

    def launch_lower_bound_s(self) -> float | None:
        return self.predicted_s

    def evaluate(self, config: dict[str, Any]) -> TrialResult:
        if self.cache.key(config) in self.hang:
            while True:
                time.sleep(3600)
        deadline = TrialDeadline(self.trial_limit_s)
        result = super().evaluate(config)
        if not result.ok:
            return result
        time.sleep(VERIFY_LAUNCHES * self.launch_s)
        recorded, times = result.time_ms, []
        for _ in range(self.repeats):
            if times and not deadline.allows(self.launch_s):
                break
            time.sleep(self.launch_s)
            times.append(recorded)
        result.times_ms = times
        return result


def make(spec: BackendSpec) -> Backend:
    assert spec.replay_file is not None
    options = dict(spec.options) or json.loads(os.environ.get(ENV, "{}"))
    return TimedReplay(spec.replay_file, **options)
