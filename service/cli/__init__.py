"""The ``kato`` command line, one module per command group: :mod:`~service.cli.serve` (serve,
worker), :mod:`~service.cli.tune` (tune, replay), :mod:`~service.cli.lookup`,
:mod:`~service.cli.tokens`, :mod:`~service.cli.operators`, :mod:`~service.cli.jobs` (jobs,
cancel, retune), :mod:`~service.cli.data` (export, import) and :mod:`~service.cli.baseline`;
what they share is in :mod:`~service.cli.common`. Commands import their heavy dependencies
when they run, so ``kato --help`` starts fast.
"""

from __future__ import annotations

# Importing a group's module registers its commands on ``app``, in this order (``kato --help``).
# isort: off
from kato.service.cli import root, serve, tune, lookup, tokens, operators, jobs  # noqa: F401
from kato.service.cli import data, baseline  # noqa: F401

# isort: on
from kato.service.cli.common import app

__all__ = ["app", "main"]


def main() -> None:  # pragma: no cover
    app()  # logging is set up by the callback (service.logs), for every way of calling it
