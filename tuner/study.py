"""A job's Optuna study as people and tools read it (``optuna.load_study``, optuna-dashboard).

Contract:

- One study per job, ``kato-job-<id>`` (:func:`job_study_name`), in the job database: Optuna's
  own tables beside Kato's. Opening an Optuna storage creates those tables, so only a tuning run
  and an import open one (:func:`optuna_storage`); nothing that only reads does.
- A trial's parameters are the config's real values (``BLOCK_SIZE: 128``), every parameter of
  the space included (one with a single value too), each over a categorical distribution of
  the parameter's values, sorted where all are numbers (:class:`StudyParams`).
- The study's user attributes name the job (:func:`job_attrs`); its objective is named
  ``time_ms``: the median time, :data:`FAILED_VALUE` for a failed or invalid config.
- The samplers see indices, as they did when the study stored them: a numeric parameter as an
  integer index into its sorted values (TPE's density model sees that 128 lies between 64 and
  256), any other as a categorical over indices. :class:`IndexSampler` converts at the
  boundary, so a search proposes exactly the configs it proposed before.
- A study written by an older Kato holds the indices themselves; :meth:`StudyParams.stored_in`
  tells, and such a job resumes on them.
"""

from __future__ import annotations

import copy
import json
import logging
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import optuna
from kato.db.session import WORKER_TIMEOUTS, configure_postgres, configure_sqlite
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    IntDistribution,
    distribution_to_json,
)
from optuna.trial import FrozenTrial, TrialState

log = logging.getLogger(__name__)

#: A study's name is this plus the job's id.
STUDY_PREFIX = "kato-job-"
#: The objective's name, as optuna-dashboard shows it.
METRIC = "time_ms"
#: Objective value of a failed or invalid config: worse than any real time (the samplers rank
#: values, so only "worse than every success" matters).
FAILED_VALUE = 1e30
#: What Optuna stores as a categorical choice; other values are shown by their ``str``.
_CHOICE_TYPES = (type(None), bool, int, float, str)


def job_study_name(job_id: str) -> str:
    return f"{STUDY_PREFIX}{job_id}"


def job_attrs(job: Any) -> dict[str, Any]:
    """The user attributes that name a job (anything with a job's fields, e.g. ``db.models.Job``):
    what its study tuned, for whom and with what budget."""
    return {
        "job_id": job.id,
        "operator": job.operator,
        "operator_version": job.operator_version,
        "shape": "x".join(str(d) for d in job.shape),
        "dtype": job.dtype,
        "gpu_model": job.gpu_model,
        "strategy": job.strategy,
        "budget_configs": job.budget_configs,
        "budget_seconds": job.budget_seconds,
    }


def describe_study(study: optuna.Study, attrs: Mapping[str, Any]) -> None:
    """Set the study's user attributes to ``attrs`` and name its objective; writes only what
    differs (a resumed job or a helper reads them once)."""
    present = study.user_attrs
    for key, value in attrs.items():
        if key not in present or present[key] != value:
            study.set_user_attr(key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if study.metric_names != [METRIC]:
            study.set_metric_names([METRIC])


def optuna_storage(db_url: str) -> optuna.storages.RDBStorage:
    """Optuna's study storage in the job database (its own tables beside Kato's, created here
    when missing: call it only to write a study).

    Its engine reconnects and waits as a worker's own (:func:`db.session.make_engine`):
    ``pool_pre_ping``, so a connection the server dropped (a restart, ``pg_terminate_backend``)
    is replaced on checkout instead of failing the next ask or tell, and the worker's
    :class:`db.session.DbTimeouts` (PostgreSQL: connect, statement and lock limits, a hung
    server an error, not a hang). SQLite: Kato's connection settings (WAL,
    ``synchronous=NORMAL``, busy timeout): with the default full sync every ask and tell waits
    for an fsync, which made a replayed trial cost ~1 s on slow disks.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    url = make_url(db_url)
    backend = url.get_backend_name()
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if backend == "sqlite":
        kwargs["connect_args"] = {"timeout": WORKER_TIMEOUTS.lock}
    elif backend == "postgresql" and url.get_driver_name() in ("psycopg", "psycopg2"):
        # Optuna's own first connections (it creates its tables) wait no longer than ours.
        kwargs["connect_args"] = {"connect_timeout": max(2, round(WORKER_TIMEOUTS.connect))}
    for attempt in range(5):
        try:
            storage = optuna.storages.RDBStorage(db_url, engine_kwargs=kwargs)
            break
        except (IntegrityError, OperationalError, ProgrammingError):
            # Two workers creating Optuna's tables in a fresh database at once: one loses the
            # race on Optuna's version row (IntegrityError), or on PostgreSQL on a table itself
            # ("relation studies already exists", ProgrammingError); the tables exist now, so
            # the next try succeeds.
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    if backend == "sqlite":
        configure_sqlite(storage.engine, WORKER_TIMEOUTS)
    elif backend == "postgresql":
        configure_postgres(storage.engine, WORKER_TIMEOUTS)
    storage.engine.dispose()  # connections opened while Optuna set up: reopen with the settings
    return storage


def _same(a: BaseDistribution | None, b: BaseDistribution | None) -> bool:
    """Equal as stored: ``(False, True)`` is not ``(0, 1)`` (Python's ``==`` says it is)."""
    return a is not None and b is not None and distribution_to_json(a) == distribution_to_json(b)


def _choice(value: Any) -> Any:
    return value if isinstance(value, _CHOICE_TYPES) else str(value)


class StudyParams:
    """How a space's parameters meet Optuna: real values in the study, indices for samplers.

    ``values``: the suggested parameters (more than one value), in space order, their values
    sorted where all are numbers (``ordered``); ``fixed``: the single-valued ones. With
    ``indices`` (a study of an older Kato) the study holds the indices and no fixed parameter.
    """

    def __init__(self, params: Mapping[str, Sequence[Any]], *, indices: bool = False):
        self.order = list(params)
        self.indices = indices
        self.values: dict[str, list[Any]] = {}
        self.ordered: dict[str, bool] = {}
        self.fixed: dict[str, Any] = {}
        choices: dict[str, list[Any]] = {}
        for name, given in params.items():
            vals = list(dict.fromkeys(given))
            numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals)
            if numeric:
                vals.sort()
            choices[name] = vals
            if len(vals) == 1:
                self.fixed[name] = vals[0]
            else:
                self.values[name] = vals
                self.ordered[name] = numeric
        self._choices = {n: tuple(_choice(v) for v in vals) for n, vals in choices.items()}
        self._position = {n: {c: i for i, c in enumerate(cs)} for n, cs in self._choices.items()}
        self._real = choices
        #: What the samplers see of each suggested parameter.
        self.index_distributions: dict[str, BaseDistribution] = {
            name: IntDistribution(0, len(vals) - 1)
            if self.ordered[name]
            else CategoricalDistribution(list(range(len(vals))))
            for name, vals in self.values.items()
        }
        #: What the study stores, for every parameter.
        self.value_distributions: dict[str, BaseDistribution] = {
            name: CategoricalDistribution(self._choices[name]) for name in self.order
        }
        self.distributions = self.index_distributions if indices else self.value_distributions

    def stored_in(self, study: optuna.Study) -> StudyParams:
        """These parameters as ``study`` stores them: with indices when a trial of it does."""
        for trial in study.get_trials(deepcopy=False):
            stored = trial.distributions.items()
            if any(_same(self.index_distributions.get(n), d) for n, d in stored):
                return StudyParams(self._real, indices=True)
            if trial.distributions:
                break
        return self

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """Ask ``trial`` for a config (the sampler picks an index per suggested parameter)."""
        chosen: dict[str, Any] = {}
        if self.indices:
            chosen.update(self.fixed)
            for name, vals in self.values.items():
                if self.ordered[name]:
                    chosen[name] = vals[trial.suggest_int(name, 0, len(vals) - 1)]
                else:
                    chosen[name] = vals[trial.suggest_categorical(name, list(range(len(vals))))]
        else:
            for name in self.order:
                picked = trial.suggest_categorical(name, self._choices[name])
                chosen[name] = self._real[name][self._position[name][picked]]
        return {name: chosen[name] for name in self.order}

    def params(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """A config as a trial's parameters (to enqueue it or add it as a finished trial)."""
        if self.indices:
            return {name: vals.index(config[name]) for name, vals in self.values.items()}
        return {name: _choice(config[name]) for name in self.order}

    def config(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """A stored trial's parameters as a config (real-valued studies)."""
        return {name: self._real[name][self._position[name][params[name]]] for name in params}

    def index_trial(self, trial: FrozenTrial) -> FrozenTrial:
        """``trial`` as the samplers see it: suggested parameters as indices, fixed ones left
        out (as the study stored them before it held real values)."""
        params, dists = {}, {}
        for name, value in trial.params.items():
            if name in self.values:
                params[name] = self._position[name][value]
                dists[name] = self.index_distributions[name]
        return FrozenTrial(
            number=trial.number,
            state=trial.state,
            value=None,
            values=trial.values,
            datetime_start=trial.datetime_start,
            datetime_complete=trial.datetime_complete,
            params=params,
            distributions=dists,
            user_attrs=trial.user_attrs,
            system_attrs=trial.system_attrs,
            intermediate_values=trial.intermediate_values,
            trial_id=trial._trial_id,
        )

    def choice_at(self, name: str, index: int) -> Any:
        return self._choices[name][index]


class _IndexView:
    """A study as a sampler inside :class:`IndexSampler` reads it: its trials with indices."""

    def __init__(self, study: optuna.Study, sampler: IndexSampler):
        self._study, self._sampler = study, sampler

    def _get_trials(
        self, deepcopy: bool = True, states: Any = None, use_cache: bool = False
    ) -> list[FrozenTrial]:
        stored = self._study._get_trials(deepcopy=False, states=states, use_cache=use_cache)
        trials = [self._sampler.index_trial(t) for t in stored]
        return copy.deepcopy(trials) if deepcopy else trials

    def get_trials(self, deepcopy: bool = True, states: Any = None) -> list[FrozenTrial]:
        return self._get_trials(deepcopy=deepcopy, states=states)

    @property
    def trials(self) -> list[FrozenTrial]:
        return self.get_trials()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)


class IndexSampler(optuna.samplers.BaseSampler):
    """Runs ``inner`` on parameter indices while the study stores real values: ``inner`` sees
    every trial with indices (:meth:`StudyParams.index_trial`) and its picks are turned back
    into values, so it makes the same picks, in the same order, as on a study of indices."""

    def __init__(self, inner: optuna.samplers.BaseSampler, params: StudyParams):
        self.inner, self._params = inner, params
        self._finished: dict[int, FrozenTrial] = {}  # a finished trial never changes

    def index_trial(self, trial: FrozenTrial) -> FrozenTrial:
        if trial.state.is_finished():
            seen = self._finished.get(trial._trial_id)
            if seen is None:
                seen = self._finished[trial._trial_id] = self._params.index_trial(trial)
            return seen
        return self._params.index_trial(trial)

    def _view(self, study: optuna.Study) -> Any:
        return _IndexView(study, self)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.inner.before_trial(self._view(study), self.index_trial(trial))

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self.inner.after_trial(self._view(study), self.index_trial(trial), state, values)

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        space = self.inner.infer_relative_search_space(self._view(study), self.index_trial(trial))
        return {name: self._params.value_distributions[name] for name in space}

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        indexed = {name: self._params.index_distributions[name] for name in search_space}
        picked = self.inner.sample_relative(self._view(study), self.index_trial(trial), indexed)
        return {name: self._params.choice_at(name, i) for name, i in picked.items()}

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        if param_name not in self._params.values:  # not a parameter of the space
            return self.inner.sample_independent(study, trial, param_name, param_distribution)
        index = self.inner.sample_independent(
            self._view(study),
            self.index_trial(trial),
            param_name,
            self._params.index_distributions[param_name],
        )
        return self._params.choice_at(param_name, index)


def _identity(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def _local(moment: datetime | None) -> datetime | None:
    """Optuna's trial times are naive local time."""
    if moment is None:
        return None
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return aware.astimezone().replace(tzinfo=None)


def record_study(
    storage: optuna.storages.BaseStorage,
    name: str,
    attrs: Mapping[str, Any],
    params: StudyParams,
    trials: Iterable[tuple[Any, ...]],
) -> int:
    """Give a job its study from Kato's records (an imported job; a job whose strategy proposes
    without Optuna, when it ends): ``trials`` as (config, objective value, measured at), or
    with a fourth item, the trial's user attributes; each config added once (one the study has
    is skipped, so importing again adds nothing). A study whose parameters are stored otherwise
    (an older Kato's indices, another space) is left as it is. Returns how many trials were
    added."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no line per study created
    study = optuna.create_study(
        storage=storage, study_name=name, direction="minimize", load_if_exists=True
    )
    describe_study(study, attrs)
    present = study.get_trials(deepcopy=False)
    expected = params.value_distributions
    if not all(_same(d, expected.get(n)) for t in present for n, d in t.distributions.items()):
        log.info("study %s stores its parameters otherwise: no trials added", name)
        return 0
    seen = {_identity(params.config(t.params)) for t in present if t.params}
    new = []
    for config, value, measured_at, *attrs in trials:
        identity = _identity(config)
        if identity in seen:
            continue
        seen.add(identity)
        trial = optuna.trial.create_trial(
            params=params.params(config),
            distributions=expected,
            value=value,
            user_attrs=attrs[0] if attrs else None,
        )
        if (moment := _local(measured_at)) is not None:
            trial.datetime_start = trial.datetime_complete = moment
        new.append(trial)
    _add_trials(storage, study, new)
    return len(new)


def _add_trials(
    storage: optuna.storages.BaseStorage, study: optuna.Study, trials: list[FrozenTrial]
) -> None:
    """Add finished trials in one transaction: ``Study.add_trials`` commits each one (26 ms a
    trial in SQLite, 68 in PostgreSQL: minutes for a Kernel Tuner cache of 18 thousand).
    Written with Optuna's own table models (stable since Optuna 3); without them, or on
    another storage, the public path."""
    try:
        from optuna.storages._rdb import models
    except ImportError:  # pragma: no cover - a future Optuna without the module
        models = None
    if not trials:
        return
    if models is None or not isinstance(storage, optuna.storages.RDBStorage):
        study.add_trials(trials)
        return
    from sqlalchemy import func, select
    from sqlalchemy.orm import Session

    study_id = storage.get_study_id_from_name(study.study_name)
    with Session(storage.engine) as session, session.begin():
        # Numbers are assigned under the study row's lock, as Optuna's own trial creation does.
        session.execute(
            select(models.StudyModel.study_id)
            .where(models.StudyModel.study_id == study_id)
            .with_for_update()
        )
        count = select(func.count()).where(models.TrialModel.study_id == study_id)
        first = session.scalar(count) or 0
        rows = []
        for number, trial in enumerate(trials, start=first):
            row = models.TrialModel(study_id=study_id, number=number, state=trial.state)
            row.datetime_start = trial.datetime_start  # a setter: Optuna 5 stores UTC
            row.datetime_complete = trial.datetime_complete
            rows.append(row)
        session.add_all(rows)
        session.flush()  # the trial ids
        values, param_rows = [], []
        for row, trial in zip(rows, trials, strict=True):
            stored, kind = models.TrialValueModel.value_to_stored_repr(trial.value)
            values.append(dict(trial_id=row.trial_id, objective=0, value=stored, value_type=kind))
            for name, value in trial.params.items():
                dist = trial.distributions[name]
                param_rows.append(
                    dict(
                        trial_id=row.trial_id,
                        param_name=name,
                        param_value=dist.to_internal_repr(value),
                        distribution_json=distribution_to_json(dist),
                    )
                )
        attr_rows = [
            dict(trial_id=row.trial_id, key=key, value_json=json.dumps(value))
            for row, trial in zip(rows, trials, strict=True)
            for key, value in trial.user_attrs.items()
        ]
        session.execute(models.TrialValueModel.__table__.insert(), values)
        if param_rows:
            session.execute(models.TrialParamModel.__table__.insert(), param_rows)
        if attr_rows:
            session.execute(models.TrialUserAttributeModel.__table__.insert(), attr_rows)
