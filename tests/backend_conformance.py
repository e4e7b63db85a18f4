"""One test class every backend must pass (Optuna's storage-conformance idea, for backends).

A concrete test module subclasses :class:`BackendConformance` and provides a ``backend`` fixture
(and, optionally, ``reference_config``: a config known to run correctly).
"""

from __future__ import annotations

import itertools
import statistics

from kato.tuner.backends.base import Backend, DeviceInfo, TrialResult, TrialStatus

FAILED = {
    TrialStatus.COMPILE_ERROR,
    TrialStatus.LAUNCH_ERROR,
    TrialStatus.VERIFY_ERROR,
    TrialStatus.TIMEOUT,
}


class BackendConformance:
    #: how many valid configs the sweep test evaluates
    sweep = 24

    def test_device_is_described(self, backend: Backend):
        info = backend.device()
        assert isinstance(info, DeviceInfo)
        assert info.name and info.model
        assert len(info.compute_capability) == 2

    def test_space_has_valid_configs(self, backend: Backend):
        space = backend.space()
        assert space.params
        valid = space.valid_configs()
        assert valid
        assert all(space.is_valid(c) for c in valid[:50])

    def test_reference_config_runs_and_is_timed(self, backend: Backend, reference_config):
        result = backend.evaluate(reference_config)
        assert isinstance(result, TrialResult)
        assert result.status is TrialStatus.OK, result.error
        assert result.times_ms and all(t > 0 for t in result.times_ms)
        assert result.time_ms == statistics.median(result.times_ms)
        assert result.config == reference_config

    def test_sweep_never_raises_and_failures_say_why(self, backend: Backend):
        valid = backend.space().valid_configs()
        step = max(1, len(valid) // self.sweep)
        results = [backend.evaluate(c) for c in itertools.islice(valid, 0, None, step)]
        assert results
        for r in results:
            assert r.status in FAILED | {TrialStatus.OK}
            if r.status in FAILED:
                assert r.error, f"failed trial without an error text: {r.config}"
                assert r.time_ms is None
            else:
                assert r.time_ms is not None and r.time_ms > 0

    def test_same_config_same_outcome(self, backend: Backend, reference_config):
        a, b = backend.evaluate(reference_config), backend.evaluate(reference_config)
        assert a.status == b.status
        # Real hardware varies a little between measurements; recordings not at all.
        assert abs(a.time_ms - b.time_ms) <= 0.25 * a.time_ms
