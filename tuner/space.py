"""A search space: named parameters with discrete values and a validity predicate."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

Config = dict[str, Any]


@dataclass
class SearchSpace:
    """Discrete parameters in a fixed order plus a predicate naming why a config is invalid.

    ``check(config)`` returns ``None`` for a valid config and a reason otherwise. The order of
    ``params`` is the Kernel Tuner key order (values comma-joined).

    ``enumerate_valid``: optional; returns every valid config in product order, for spaces that
    know their valid configs without walking the product (a recorded space of 20 thousand
    configs out of a product of 10 million: ``check`` over the product takes half a minute).
    It must agree with ``check``.
    """

    params: dict[str, tuple[Any, ...]]
    check: Callable[[Config], str | None] = lambda config: None
    enumerate_valid: Callable[[], list[Config]] | None = field(default=None, repr=False)
    _valid: list[Config] | None = field(default=None, repr=False)

    def key(self, config: Mapping[str, Any]) -> str:
        return ",".join(str(config[name]) for name in self.params)

    def all_configs(self) -> Iterator[Config]:
        names = list(self.params)
        for values in itertools.product(*self.params.values()):
            yield dict(zip(names, values, strict=True))

    def valid_configs(self) -> list[Config]:
        """Every valid config, in product order (computed once)."""
        if self._valid is None and self.enumerate_valid is not None:
            self._valid = self.enumerate_valid()
        elif self._valid is None:
            self._valid = [c for c in self.all_configs() if self.check(c) is None]
        return self._valid

    def is_valid(self, config: Config) -> bool:
        return self.check(config) is None

    def __len__(self) -> int:
        n = 1
        for values in self.params.values():
            n *= len(values)
        return n
