"""SQLAlchemy 2.0 models: tuning jobs (the queue), their trials, and the best config per result key.

Table names carry a ``kato_`` prefix because Optuna's RDB storage shares the database and owns
tables such as ``studies`` and ``trials``; the Alembic version table is ``kato_alembic_version``
for the same reason (Optuna uses ``alembic_version``).

Datetimes are timezone-aware UTC on the Python side on every backend (:class:`UTCDateTime`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

#: Status of a trial row that is a reservation (a config being measured, :mod:`db.ledger`),
#: not a result; ``reserved_by`` names the worker measuring it.
RESERVED = "running"

#: The columns of a trial row that hold its result, under the names of the keys of
#: :meth:`tuner.backends.base.TrialResult.to_dict` (which holds ``config`` too).
RESULT_COLUMNS = (
    "status",
    "time_ms",
    "times_ms",
    "compile_time_s",
    "registers",
    "shared_static_bytes",
    "shared_dynamic_bytes",
    "local_bytes",
    "blocks_per_sm",
    "occupancy",
    "error",
)


def result_values(result: Mapping[str, Any]) -> dict[str, Any]:
    """The column values that store ``result`` (:meth:`TrialResult.to_dict`) in a trial row:
    the one mapping from a result to its row (:meth:`Trial.result` is the way back). Missing
    figures are ``None``, missing times an empty list; ``status`` is required."""
    values = {name: result.get(name) for name in RESULT_COLUMNS}
    values["status"] = str(result["status"])
    values["times_ms"] = list(result.get("times_ms") or [])
    return values


# Deterministic constraint names: Alembic needs them to alter constraints later (batch mode on
# SQLite recreates tables and must know what each constraint is called).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


def new_job_id() -> str:
    return uuid.uuid4().hex


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored as UTC and always returned timezone-aware (UTC).

    SQLite has no timezone support and returns naive values; PostgreSQL stores ``timestamptz``.
    Naive values written from Python are taken to be UTC already.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON, list[int]: JSON}


class Job(Base):
    """One tuning request: a row in the queue, then the running search's progress and result."""

    __tablename__ = "kato_jobs"
    __table_args__ = (Index("ix_kato_jobs_claim", "status", "gpu_model", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_job_id)
    operator: Mapped[str] = mapped_column(String(64))
    operator_version: Mapped[str] = mapped_column(String(64))
    shape: Mapped[list[int]]
    shape_key: Mapped[str] = mapped_column(String(255))
    dtype: Mapped[str] = mapped_column(String(32))
    gpu_model: Mapped[str] = mapped_column(String(64))  # canonical catalog name, e.g. "H200"
    budget_configs: Mapped[int] = mapped_column(Integer)
    budget_seconds: Mapped[float | None] = mapped_column(Float)
    strategy: Mapped[str] = mapped_column(String(16), default="forest")
    seed: Mapped[int] = mapped_column(Integer, default=0)
    # Indexed through ix_kato_jobs_claim, whose leading column it is.
    status: Mapped[str] = mapped_column(String(16), default="queued")
    trials_done: Mapped[int] = mapped_column(Integer, default=0)
    best_time_ms: Mapped[float | None] = mapped_column(Float)
    best_config: Mapped[dict[str, Any] | None]
    error: Mapped[str | None] = mapped_column(Text)
    worker_id: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    #: The API token that submitted the job (None: submitted without a token, e.g. by the CLI).
    token_id: Mapped[str | None] = mapped_column(String(32), index=True)
    #: The batch it was submitted in (``POST /v1/jobs/batch``; None: submitted alone).
    batch_id: Mapped[str | None] = mapped_column(String(32), index=True)
    #: Seconds the GPU was held for this job's measurements (verify and timed launches, every
    #: worker's runs added up: :mod:`tuner.gpu_gate`), and that over the job's wall time
    #: (``started_at`` to ``finished_at``) once it has ended. None: not measured (older rows).
    gpu_busy_s: Mapped[float | None] = mapped_column(Float)
    gpu_busy_fraction: Mapped[float | None] = mapped_column(Float)

    trials: Mapped[list[Trial]] = relationship(
        back_populates="job",
        order_by="Trial.number",
        cascade="all, delete-orphan",
        passive_deletes=True,
    )

    def __repr__(self) -> str:
        return (
            f"Job(id={self.id!r}, operator={self.operator!r}, shape={self.shape_key!r}, "
            f"dtype={self.dtype!r}, gpu={self.gpu_model!r}, status={self.status!r})"
        )


class Trial(Base):
    """One evaluated config of a job: everything the backend measured, failures included."""

    __tablename__ = "kato_trials"
    __table_args__ = (
        UniqueConstraint("job_id", "config_key"),
        UniqueConstraint("job_id", "number"),  # numbers 0, 1, 2, ... without repeats
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("kato_jobs.id", ondelete="CASCADE"), index=True
    )
    number: Mapped[int] = mapped_column(Integer)  # 0, 1, 2, ... per job (db.ledger: trial numbers)
    config: Mapped[dict[str, Any]]
    config_key: Mapped[str] = mapped_column(String(1024))  # Kernel Tuner key: "256,4"
    status: Mapped[str] = mapped_column(String(32))  # kato.shared.status.TrialStatus values
    time_ms: Mapped[float | None] = mapped_column(Float)  # median of times_ms, OK trials only
    times_ms: Mapped[list[float]] = mapped_column(JSON, default=list)
    compile_time_s: Mapped[float | None] = mapped_column(Float)
    registers: Mapped[int | None] = mapped_column(Integer)
    shared_static_bytes: Mapped[int | None] = mapped_column(Integer)
    shared_dynamic_bytes: Mapped[int | None] = mapped_column(Integer)
    local_bytes: Mapped[int | None] = mapped_column(Integer)
    blocks_per_sm: Mapped[int | None] = mapped_column(Integer)
    occupancy: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    #: The worker that reserved the config (:mod:`db.ledger`) and when: while ``status`` is
    #: :data:`RESERVED` it is measuring it; once the result is stored, the worker that measured
    #: it. ``None``: stored without a reservation (an import) or before migration 0007.
    reserved_by: Mapped[str | None] = mapped_column(String(255))
    reserved_at: Mapped[datetime | None]

    job: Mapped[Job] = relationship(back_populates="trials")

    @property
    def reserved(self) -> bool:
        """Whether this is a placeholder: a config being measured, not a result."""
        return self.status == RESERVED

    def result(self) -> dict[str, Any]:
        """The stored result in the shape of :meth:`tuner.backends.base.TrialResult.to_dict`
        (``config``, ``status``, the figures and ``error``): the inverse of
        :func:`result_values`. A row stored with a median only gets it as its one time."""
        values = {name: getattr(self, name) for name in RESULT_COLUMNS}
        values["times_ms"] = list(
            self.times_ms or ([self.time_ms] if self.time_ms is not None else [])
        )
        return {"config": dict(self.config), **values}

    def __repr__(self) -> str:
        return (
            f"Trial(job_id={self.job_id!r}, number={self.number}, key={self.config_key!r}, "
            f"status={self.status!r}, time_ms={self.time_ms})"
        )


class BestConfig(Base):
    """The fastest known config for one result key (see ``DESIGN.md``: contracts)."""

    __tablename__ = "kato_best_configs"
    __table_args__ = (
        UniqueConstraint(
            "operator",
            "operator_version",
            "shape_key",
            "dtype",
            "gpu_model",
            "compute_capability",
            "cuda_version",
            name="uq_kato_best_configs_key",
        ),
        Index("ix_kato_best_configs_lookup", "operator", "dtype", "gpu_model"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    operator: Mapped[str] = mapped_column(String(64))
    operator_version: Mapped[str] = mapped_column(String(64))
    shape: Mapped[list[int]]
    shape_key: Mapped[str] = mapped_column(String(255))
    dtype: Mapped[str] = mapped_column(String(32))
    gpu_model: Mapped[str] = mapped_column(String(64))
    compute_capability: Mapped[str] = mapped_column(String(16))  # "9.0"
    cuda_version: Mapped[str] = mapped_column(String(32))  # "13.0"
    config: Mapped[dict[str, Any]]
    time_ms: Mapped[float] = mapped_column(Float)
    job_id: Mapped[str | None] = mapped_column(
        String(32), ForeignKey("kato_jobs.id", ondelete="SET NULL")
    )
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    #: The operator's default config measured on this key's shape (its job measures it first):
    #: a lookup serves this winner for another shape only where it beat the default here by
    #: more than ``service.lookup.NEAREST_MIN_GAIN``. None: not measured (rows before 0006).
    default_ms: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    #: PyTorch's own op on the same inputs (:mod:`tuner.framework`), and which framework it
    #: was ("torch 2.13.0+cu130"). None: not measured (no torch, turned off, a failure); a
    #: mismatch's time is stored, its framework marked " (mismatch)" (tuner.framework).
    framework_ms: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    framework: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)
    #: The same op compiled by ``torch.compile`` (Inductor), timed in the same child after the
    #: eager one, and what it was ("torch.compile 2.14.1 inductor"): the bar for a call inside
    #: a compiled graph (kato_torch.policy). None: not measured (rows before 0009, turned
    #: off, torch.compile unavailable or failed); a mismatch is stored marked as above.
    compiled_ms: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    compiled: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)

    def __repr__(self) -> str:
        return (
            f"BestConfig(operator={self.operator!r}, shape={self.shape_key!r}, "
            f"dtype={self.dtype!r}, gpu={self.gpu_model!r}, time_ms={self.time_ms})"
        )


class Worker(Base):
    """A worker process seen by the queue: its GPU models and its last heartbeat.

    Workers upsert their row on start and on every heartbeat; ``GET /v1/workers`` lists them, and
    a queued job whose GPU model no live worker advertises says so. Rows of workers that stopped
    heartbeating stay (with ``status`` ``stopped`` or a stale ``heartbeat_at``) for diagnosis.
    """

    __tablename__ = "kato_workers"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)  # host:pid:uuid
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    gpu_models: Mapped[list[str]] = mapped_column(JSON, default=list)  # canonical catalog names
    devices: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    backend: Mapped[str] = mapped_column(String(32))  # pycuda | replay
    status: Mapped[str] = mapped_column(String(16), default="idle")  # idle | busy | stopped
    current_job_id: Mapped[str | None] = mapped_column(String(32))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)

    def __repr__(self) -> str:
        return f"Worker(id={self.id!r}, gpus={self.gpu_models!r}, status={self.status!r})"


class ApiToken(Base):
    """An API token for the write routes. Only the SHA-256 of the secret is stored.

    The secret is shown once, by ``kato token create``; a request presents it as
    ``Authorization: Bearer <secret>``. Revoked tokens stay (``revoked_at`` set) so that the jobs
    they submitted keep their owner.
    """

    __tablename__ = "kato_api_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_job_id)
    name: Mapped[str] = mapped_column(String(255))
    secret_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    #: Most queued + running jobs this token may have at once (None: the service default).
    max_queued_jobs: Mapped[int | None] = mapped_column(Integer)
    #: May cancel any job, not only its own (``kato token create NAME --admin``).
    admin: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    #: May register user operators (``POST /v1/operators``; ``kato token create NAME
    #: --operators``): CUDA that workers will compile and run.
    operators: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]

    def __repr__(self) -> str:
        revoked = self.revoked_at is not None
        return f"ApiToken(id={self.id!r}, name={self.name!r}, revoked={revoked})"


class UserOperator(Base):
    """One version of a user operator registered at runtime (``kato operator add DIR``,
    ``POST /v1/operators``): its definition (the spec and its files' text,
    :class:`kernels.user.OperatorDefinition` as JSON), never Python code.

    A name's versions are its rows; the newest (highest id) is the one served and tuned.
    Re-adding an unchanged definition finds its row; one changed only outside its version (its
    description, its ``[backward]`` section) replaces them in that row; any other change adds a
    version (``db.operators.add_operator``).
    """

    __tablename__ = "kato_user_operators"
    __table_args__ = (UniqueConstraint("name", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), index=True)
    version: Mapped[str] = mapped_column(String(12))
    definition: Mapped[dict[str, Any]] = mapped_column(JSON)
    token_id: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    def __repr__(self) -> str:
        return f"UserOperator(name={self.name!r}, version={self.version!r})"
