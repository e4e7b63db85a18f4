"""One router per resource: health, operators, GPUs, configs (lookups), jobs."""

from kato.service.routes import configs, gpus, health, jobs, operators

__all__ = ["configs", "gpus", "health", "jobs", "operators"]
