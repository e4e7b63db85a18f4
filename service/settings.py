"""Service settings, read once at the entry point from ``KATO_*`` environment variables."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from db.session import default_db_url, normalize_db_url


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
