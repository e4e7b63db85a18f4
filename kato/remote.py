"""``kato.tune_kernel(..., service=URL)``: register the operator with a Kato service, submit a
job to its workers, wait for it, and return its trials in Kernel Tuner's shape."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from kato.errors import ServiceError
from kato.shared.status import TERMINAL_STATUSES
from kato.tune import result_row, tuning_env


def _checked(response: Any, what: str) -> Any:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail")
        except ValueError:
            detail = response.text[:500]
        raise ServiceError(f"{what}: HTTP {response.status_code}: {detail}", response.status_code)
    return response.json()


def tune_on_service(
    url: str, token: str | None, op: Any, spec: dict[str, Any], shape: tuple[int, ...],
    dtype: str, gpu: str, strategy: str, budget: int, seconds: float | None, seed: int,
    timeout_s: float, poll_s: float = 1.0,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Register, submit, wait (up to ``timeout_s``), and shape the trials as
    :func:`kato.tune_kernel` does. Raises :class:`ServiceError` for a refused request and
    ``TimeoutError`` for a job still running at the timeout (it keeps running there)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=60) as client:
        added = _checked(
            client.post("/v1/operators", json={"spec": spec, "files": op.definition.files}),
            "registering the operator",
        )
        body: dict[str, Any] = {
            "operator": added["name"], "shape": list(shape), "dtype": dtype, "gpu": gpu,
            "budget": budget, "strategy": strategy, "seed": seed,
        }  # fmt: skip
        if seconds is not None:
            body["budget_seconds"] = seconds
        t0 = time.perf_counter()
        job = _checked(client.post("/v1/jobs", json=body), "submitting the job")
        deadline = time.monotonic() + timeout_s
        while job["status"] not in TERMINAL_STATUSES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job['id']} still {job['status']} after {timeout_s} s")
            time.sleep(poll_s)
            job = _checked(client.get(f"/v1/jobs/{job['id']}"), "following the job")
        elapsed = time.perf_counter() - t0
        trials = _checked(client.get(f"/v1/jobs/{job['id']}/trials"), "reading the trials")
    rows = [result_row(SimpleNamespace(**t), list(op.params), 0) for t in trials]
    info = SimpleNamespace(name=gpu, model=gpu, compute_capability=("?",), cuda_version="service")
    env = tuning_env(op, shape, dtype, info, strategy, budget, seconds, job["id"], job["status"],
               job["best_config"], rows, elapsed, 0)  # fmt: skip
    env["kato_operator_version"] = added["version"]
    env["service"] = url
    env["error"] = job.get("error")
    return rows, env
