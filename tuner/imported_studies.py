"""Optuna studies for jobs measured elsewhere (imported): what optuna-dashboard shows of them.

A tuned job's study is written as it runs (:mod:`tuner.worker`); an imported job gets the same
view after the import commits (:func:`record_job_studies`, the hook ``kato import`` hands
:func:`db.importer.import_paths`): study ``kato-job-<id>`` naming the job, one finished trial per
stored trial with the config's real values (:mod:`tuner.study`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kato.db.models import RESERVED, Job, Trial
from kato.kernels import get_operator
from kato.tuner.study import (
    FAILED_VALUE,
    StudyParams,
    job_attrs,
    job_study_name,
    optuna_storage,
    record_study,
)
from sqlalchemy import select
from sqlalchemy.orm import Session

from kato.errors import InvalidInput

log = logging.getLogger(__name__)


def _space(job: Job, rows: Sequence[Trial]) -> Mapping[str, Sequence[Any]]:
    """The parameters a study of ``job`` ranges over: its operator's space when every stored
    config lies in it (as a tuning run's study would), else the values its trials hold (a
    Kernel Tuner cache of an operator not registered here, an older version's space)."""
    try:
        space: Mapping[str, Sequence[Any]] = get_operator(job.operator).params
    except InvalidInput:
        space = {}
    fits = bool(space) and all(
        set(r.config) == set(space) and all(v in space[n] for n, v in r.config.items())
        for r in rows
    )
    if fits or not rows:
        return space
    names = list(rows[0].config)
    return {name: [r.config[name] for r in rows if name in r.config] for name in names}


def record_job_studies(session: Session, job_ids: Sequence[str]) -> list[str]:
    """Write the study of each of ``job_ids`` (committed jobs) from its stored trials; a config
    the study has already is not added again. Returns warnings: a study that could not be
    written is the view's loss, never the import's (its rows are committed)."""
    url = session.get_bind().url
    if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
        return []  # another connection would see another, empty database
    ids = list(dict.fromkeys(job_ids))
    if not ids:
        return []
    try:
        storage = optuna_storage(url.render_as_string(hide_password=False))
    except Exception as exc:
        log.exception("opening the Optuna storage failed")
        return [f"the imported jobs have no Optuna study (optuna-dashboard's view): {exc}"]
    warnings = []
    try:
        for job in session.scalars(select(Job).where(Job.id.in_(ids))):
            rows = session.scalars(
                select(Trial)
                .where(Trial.job_id == job.id, Trial.status != RESERVED)
                .order_by(Trial.number, Trial.id)
            ).all()
            trials = [
                (r.config, r.time_ms if r.time_ms is not None else FAILED_VALUE, r.created_at)
                for r in rows
            ]
            try:
                params = StudyParams(_space(job, rows))
                record_study(storage, job_study_name(job.id), job_attrs(job), params, trials)
            except Exception as exc:
                log.exception("writing the Optuna study of job %s failed", job.id)
                warnings.append(f"job {job.id} has no Optuna study (optuna-dashboard): {exc}")
    finally:
        storage.engine.dispose()
    return warnings
