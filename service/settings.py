"""Service settings, read once at the entry point from ``KATO_*`` environment variables."""

from __future__ import annotations

from kato.db.session import DbTimeouts, default_db_url, normalize_db_url
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Connections an API process's pool holds beyond one per API thread: for sessions opened on
#: threads of their own, outside AnyIO's pool (the GPU workers ``kato serve`` runs in the
#: process: heartbeat, write-behind, search).
API_POOL_HEADROOM = 10


class Settings(BaseSettings):
    """Configuration of the API (and of the workers ``kato serve`` starts beside it).

    Every field can be set through the environment: ``KATO_DB_URL``, ``KATO_PORT``, ...
    """

    model_config = SettingsConfigDict(env_prefix="KATO_", extra="ignore")

    db_url: str = Field(
        default_factory=default_db_url,
        description="SQLAlchemy URL or SQLite file path (default ~/.local/share/kato/kato.db)",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    max_batch: int = Field(default=256, ge=1, description="most jobs in one POST /v1/jobs/batch")
    max_budget_configs: int = Field(default=5000, ge=1, le=2**31 - 1)
    max_budget_seconds: float = Field(default=86400.0, gt=0, allow_inf_nan=False)
    default_budget_configs: int = Field(default=100, ge=1, le=2**31 - 1)
    lease_seconds: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    api_threads: int = Field(
        default=40,
        ge=1,
        le=1000,
        description="threads per API process for blocking work (sync routes and dependencies, "
        "lookups): AnyIO's default thread limit, set at startup; the process's database pool "
        "holds one connection per thread plus headroom (api_db_connections)",
    )
    db_connect_timeout_seconds: float = Field(
        default=3.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="API: longest wait to open a PostgreSQL connection or to get an answer to "
        "a pooled connection's liveness ping; a server that accepts TCP and never answers "
        "gets a 503 after it",
    )
    db_statement_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="API: longest a PostgreSQL statement of a request may run "
        "(statement_timeout; the client gives up 2 s later on a server that stopped "
        "answering): a 503 after it",
    )
    db_lock_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="API: longest a request waits for a lock another transaction holds "
        "(SQLite's write lock: busy timeout; PostgreSQL: lock_timeout), then a 503 busy with "
        "Retry-After; workers wait 30 s and retry",
    )

    # --- workers (README: "Faults on the GPU", "Several hosts") ---
    trial_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        allow_inf_nan=False,
        description="per-trial limit (compile, verify, time) of an isolated measurement; a "
        "config past it is recorded as a timeout and its process replaced",
    )
    isolate: bool = Field(
        default=True,
        description="GPU workers measure in a child process that a faulting kernel cannot "
        "take down (false: in the worker process itself)",
    )
    lookahead: int = Field(
        default=4,
        ge=1,
        le=64,
        description="configs a job's search may ask for ahead while the GPU would wait on nvcc "
        "for the one asked before (measured as their compiles finish; 1: ask, measure, ask)",
    )
    jobs_per_worker: int = Field(
        # 3: measured to keep the GPU busier than one job at a time with the same winners
        # (docs/design.md, "Default 3"); jobs are admitted by GPU memory (tuner/admission.py).
        default=3,
        ge=1,
        le=16,
        description="jobs a GPU worker holds at once on its one GPU, taking turns measuring "
        "(one measurement at a time) so the GPU measures while a job waits on nvcc or its "
        "search; each job's trials are those it would run alone; a job is taken only if the "
        "jobs held fit the GPU's memory together (1: one job at a time)",
    )
    max_workers_per_job: int = Field(
        default=4,
        ge=1,
        description="most workers sharing one job (1: no sharing); idle workers join running "
        "jobs with enough budget left",
    )

    # --- security and limits (README: "Security and limits") ---
    auth_required: bool = Field(
        default=True,
        description="write routes (submit, batch, cancel, import) need an API token; "
        "false: anyone who reaches the port may write (local single-user use only)",
    )
    auth_reads: bool = Field(
        default=False, description="read routes need an API token too (default: reads are open)"
    )
    max_body_bytes: int = Field(
        default=1 << 20, ge=1024, description="largest request body; larger ones get a 413"
    )
    max_queued_jobs: int = Field(
        default=100,
        ge=1,
        le=2**31 - 1,
        description="most queued + running jobs per token (a token's own max_queued_jobs wins)",
    )
    queue_retry_after_seconds: int = Field(
        default=60, ge=1, description="Retry-After sent with a 429 for a full per-token queue"
    )
    lookup_cache_seconds: float = Field(
        default=30.0,
        ge=0,
        allow_inf_nan=False,
        description="longest a config lookup is answered from memory (0: no cache)",
    )
    lookup_cache_check_seconds: float = Field(
        default=0.5,
        gt=0,
        allow_inf_nan=False,
        description="how often each API process checks whether a new winner was stored "
        "(then it drops its cached lookups)",
    )
    lookup_cache_entries: int = Field(default=10_000, ge=1)
    nearest_max_distance: float = Field(
        default=4.0,
        ge=0,
        allow_inf_nan=False,
        description="farthest tuned shape a lookup serves for an untuned one: the sum over "
        "dimensions of |log2(tuned / asked)| (4: e.g. one dimension 16x off, or two 4x; 0: exact "
        "shapes only). Beyond it the operator's default config is served: a far shape's winner "
        "can lose to the default (docs/design.md, 'Lookup').",
    )

    nearest_min_gain: float = Field(
        default=1.05,
        ge=0,
        allow_inf_nan=False,
        description="a nearest tuned shape's winner is served only where it beat the "
        "operator's default config on its own shape by more than this factor (its job timed "
        "both), else the default is (measured on the H200's recorded spaces: docs/defaults.md). "
        "0: no guard",
    )
    framework_baseline: bool = Field(
        default=True,
        description="after a job, GPU workers also time PyTorch's own op on the job's inputs "
        "(where torch imports and sees the job's GPU; checked against the float64 references "
        "first) and store it beside the winner: lookups report framework_ms and speedup "
        "(kato.tuner.framework; false: not timed)",
    )
    framework_compiled: bool = Field(
        default=True,
        description="with framework_baseline, the same child also compiles PyTorch's op with "
        "torch.compile (Inductor, default mode, dynamic=False) and times it the same way: "
        "lookups report compiled_ms and compiled_speedup, kato_torch's bar inside a compiled "
        "graph (seconds of compiling per key, within the baseline's timeout; skipped where "
        "torch.compile is unavailable; false: not compiled)",
    )

    @property
    def api_db_connections(self) -> int:
        """Connections in an API process's pool: one per API thread (a request holds one only
        while its thread runs: ``service.deps``) plus :data:`API_POOL_HEADROOM`."""
        return self.api_threads + API_POOL_HEADROOM

    @property
    def db_timeouts(self) -> DbTimeouts:
        """The API's database limits: brief, so a request meets a fault as a quick 503."""
        return DbTimeouts(
            connect=self.db_connect_timeout_seconds,
            statement=self.db_statement_timeout_seconds,
            lock=self.db_lock_timeout_seconds,
        )

    @field_validator("db_url")
    @classmethod
    def _db_url(cls, value: str) -> str:
        return normalize_db_url(value)

    @model_validator(mode="after")
    def _default_within_max(self) -> Settings:
        if self.default_budget_configs > self.max_budget_configs:
            raise ValueError(
                f"default_budget_configs ({self.default_budget_configs}) exceeds "
                f"max_budget_configs ({self.max_budget_configs})"
            )
        return self
