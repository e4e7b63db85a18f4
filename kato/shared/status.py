"""Job and trial statuses: the values stored in ``kato_jobs.status`` and ``kato_trials.status``,
served by the API and written to exported files."""

from __future__ import annotations

from enum import StrEnum

#: Job states. ``queued`` and ``running`` are live; the other three are terminal.
JOB_STATUSES = ("queued", "running", "done", "failed", "cancelled")
TERMINAL_STATUSES = ("done", "failed", "cancelled")


class TrialStatus(StrEnum):
    """What one evaluation of one config came to (``kato_trials.status``)."""

    OK = "ok"
    COMPILE_ERROR = "compile_error"
    LAUNCH_ERROR = "launch_error"  # includes out-of-resources and faults during a launch
    VERIFY_ERROR = "verify_error"  # ran, but the output did not match the float64 reference
    TIMEOUT = "timeout"  # no result within the per-trial time limit (hang, deadlock, slow nvcc)
    CRASHED = "crashed"  # the process measuring it died (abort, segfault, killed)
    #: Shared jobs only: being measured by another worker right now. A placeholder the search
    #: keeps so it neither proposes the config again nor overruns the budget; never stored.
    PENDING = "pending"
    INVALID = "invalid"  # rejected by the constraints; never measured, never counted
