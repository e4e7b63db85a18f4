"""User operators whose CUDA source differs per config: a table of plain sources.

Kernel Tuner's ``kernel_source`` may be a code generator, a Python callable taking a config's
tunables and returning its source (its ``vector_add_codegen.py``; a Jinja2 template's bound
``render`` in ``vector_add_jinja.py``). Kato never runs a caller's Python outside the
caller's process: ``kato.tune_kernel`` calls the generator there, once for each config that
passes the spec's checks that hold at every problem size
(:meth:`~kernels.user.spec.UserOperatorSpec.check_any_size`: a restriction naming a shape
name, a grid limit, is left to the check at each size), and builds a
:class:`GeneratedOperatorSpec` from the results. So the table, and the version that hashes
it, is the same at every problem size: results of one size are the nearest answer and the warm
start at another, as for a string source. That operator holds only data (the table of sources,
deduplicated), so it pickles to the isolated measuring child, is registered, compiled,
recorded and replayed as any user operator; its version hashes every source of the table with
the rest of the spec.

Configs outside the table (never rendered: refused at every size, or left out by a
restriction function when it was built) are refused by :meth:`GeneratedOperatorSpec.check`,
:meth:`GeneratedOperatorSpec.check_any_size` and the screens with the reason, and
:meth:`GeneratedOperatorSpec.render` raises for them: there is no generator to ask.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from kato.kernels.spec import Config, InvalidInput, code_fingerprint
from kato.kernels.user.model import MAX_FILE_BYTES, OperatorDefinition, include_error
from kato.kernels.user.spec import UserOperatorSpec, render_source

#: Most configs whose sources one operator's table holds. The generator runs once for each,
#: up front, in the caller's process, and every source travels with the operator to the
#: measuring child: a larger space must be narrowed (``tune_params``, ``restrictions``).
MAX_GENERATED_CONFIGS = 10_000
#: Most bytes (UTF-8) of distinct sources one operator's table holds: the table is pickled
#: whole to every measuring child it starts (through a pipe, held twice on each side while
#: it travels), so 10 000 sources of up to a megabyte each must not reach it.
MAX_GENERATED_BYTES = 256 << 20
#: The definition's template file of a generated operator: it is never compiled (every
#: config renders its table entry); it says where the sources are for whoever reads it.
PLACEHOLDER = (
    "// kernel_source was a code generator: each config's CUDA source is in the operator's\n"
    "// table (kato.kernels.user.generated.GeneratedOperatorSpec), not in this file.\n"
)

#: What to do instead of a quoted include in a generated source: a generator has no headers
#: (it runs in the caller's process, so it can read the file itself).
GENERATOR_INCLUDE_ADVICE = (
    "a generated source has no headers: have the generator put the header's text into the "
    "source (read the file, or a Jinja2 {% include %}), or include system headers by <name>"
)

Key = tuple[Any, ...]


def returned_source(config: Mapping[str, Any], text: Any) -> str:
    """What a code generator returned for ``config``, as a plain ``str``.

    A ``str`` subclass (markupsafe's Markup, the caller's own) becomes a plain ``str``: its
    class would be pickled with the table, and one defined in a script or a function does not
    unpickle in the measuring child (the operator would not be sent).

    Raises:
        InvalidInput: ``text`` is not a string (the config and the type named).
    """
    if not isinstance(text, str):
        raise InvalidInput(
            f"the code generator returned a {type(text).__name__} for config {dict(config)}; "
            "it must return the kernel's CUDA source as a string"
        )
    return str.__str__(text)


class GeneratedOperatorSpec(UserOperatorSpec):
    """A :class:`UserOperatorSpec` whose template is one plain CUDA source per config.

    Args:
        definition: the spec (its launch, arguments, restrictions...) and a template file that
            is not compiled (:data:`PLACEHOLDER`).
        sources: config (tunable -> value, every tunable) -> its CUDA source as the generator
            returned it, at most :data:`MAX_GENERATED_CONFIGS`. Each must be what a template
            file may be (text of at most ``MAX_FILE_BYTES``, no NUL, no ``#include`` of a
            file: the template's rules), at most :data:`MAX_GENERATED_BYTES` of distinct
            sources in all. Kept as data only, as exact ``str`` (a subclass is copied to one,
            so nothing of the caller's code travels with the table): no callable is held.
        by_functions: restriction functions (Python of the caller, called at the tuned
            size only) left configs out of ``sources``: their answers at another size are
            unknown, so :attr:`checks_every_size` is False.
        options: :class:`UserOperatorSpec`'s (``arguments``, ``answer``, ``constants``,
            ``verify``).

    Raises:
        InvalidInput: a source that is not text or breaks a template's rules, or a config not
            of this space, named in the message; more than :data:`MAX_GENERATED_CONFIGS`,
            or over :data:`MAX_GENERATED_BYTES` of distinct sources.
    """

    def __init__(
        self,
        definition: OperatorDefinition,
        sources: Sequence[tuple[Config, str]] | Mapping[Key, str],
        *,
        by_functions: bool = False,
        **options: Any,
    ):
        super().__init__(definition, **options)
        self.checks_every_size = not by_functions
        pairs = (
            [(dict(zip(self.params, key, strict=True)), text) for key, text in sources.items()]
            if isinstance(sources, Mapping)
            else list(sources)
        )
        if len(pairs) > MAX_GENERATED_CONFIGS:
            raise InvalidInput(
                f"{len(pairs)} generated sources; at most {MAX_GENERATED_CONFIGS} configs can "
                "be generated up front: restrict tune_params or restrictions"
            )
        # Identical sources (a generator that ignores a tunable) are stored once: the table
        # is pickled to every measuring child.
        self._texts: list[str] = []
        self._source_of: dict[Key, int] = {}
        position: dict[str, int] = {}
        total = 0
        for config, text in pairs:
            if reason := self.check_params(config):
                raise InvalidInput(f"generated source for config {config}: {reason}")
            text = returned_source(config, text)
            if reason := _text_error(text):
                raise InvalidInput(f"the source generated for config {config}: {reason}")
            if text not in position:
                total += len(text.encode("utf-8", errors="surrogatepass"))
                if total > MAX_GENERATED_BYTES:
                    raise InvalidInput(
                        f"the generated sources are over {MAX_GENERATED_BYTES} bytes in all "
                        f"(at config {config}); every source travels to the measuring process: "
                        "restrict tune_params or restrictions"
                    )
                position[text] = len(self._texts)
                self._texts.append(text)
            self._source_of[self.key(config)] = position[text]

    def key(self, config: Mapping[str, Any]) -> Key:
        """A config's row of the table: its values in ``tune_params`` order."""
        return tuple(config[name] for name in self.params)

    @property
    def generated_configs(self) -> int:
        """How many configs the table holds a source for."""
        return len(self._source_of)

    def source_for(self, config: Mapping[str, Any]) -> str | None:
        """The generator's source for ``config``, or None where it was not generated."""
        try:
            index = self._source_of.get(self.key(config))
        except (KeyError, TypeError):  # a tunable missing, or a value that does not hash
            return None
        return None if index is None else self._texts[index]

    @cached_property
    def version(self) -> str:
        """:class:`UserOperatorSpec`'s version (the spec, its files, Kato's code), this
        module's code and every (config, source) row of the table, in a fixed order: another
        source for any config is another version."""
        h = hashlib.sha256(UserOperatorSpec.version.func(self).encode())  # type: ignore[attr-defined]
        h.update(code_fingerprint(Path(inspect.getfile(GeneratedOperatorSpec)).read_text()))
        rows = sorted(
            (json.dumps(list(key), default=str), index) for key, index in self._source_of.items()
        )
        for key, index in rows:
            h.update(key.encode() + b"\0")
            h.update(hashlib.sha256(self._texts[index].encode()).digest())
        return h.hexdigest()[:12]

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["generated_configs"] = self.generated_configs
        return out

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """:meth:`UserOperatorSpec.check`, and a config must be in the table."""
        reason = super().check(config, shape, dtype)
        if reason is None and self.source_for(config) is None:
            return _NOT_GENERATED
        return reason

    def check_any_size(self, config: Config, dtype: str) -> str | None:
        """:meth:`UserOperatorSpec.check_any_size`, and a config must be in the table (which
        is the same at every size)."""
        reason = super().check_any_size(config, dtype)
        if reason is None and self.source_for(config) is None:
            return _NOT_GENERATED
        return reason

    def _screen(self, columns: Mapping[str, np.ndarray], n: int, *args: Any) -> np.ndarray:
        # screen(), screen_any_size() and default_config() go through here: a config valid by
        # the spec but outside the table is refused as check() refuses it. Only the rows the
        # spec accepts are looked up (at most the space's valid configs, one dict lookup each).
        ok = super()._screen(columns, n, *args)
        names = list(self.params)
        for i in np.flatnonzero(ok).tolist():
            key = tuple(_plain(columns[name][i]) for name in names)
            if key not in self._source_of:
                ok[i] = False
        return ok

    def render(self, config: Config, shape: Sequence[int], dtype: str) -> str:
        """The macros (:meth:`defines`, as for any user operator), then the config's source
        from the table, wrapped in ``extern "C"`` where it has none.

        Raises:
            InvalidInput: ``config`` is not in the table."""
        text = self.source_for(config)
        if text is None:
            raise InvalidInput(f"config {dict(config)}: {_NOT_GENERATED}")
        return render_source(self.defines(config, shape, dtype), text)


_NOT_GENERATED = (
    "no source was generated for this config (kato.tune_kernel runs a code generator for each "
    "config that passes the restrictions and limits holding at every problem size, and that "
    "its restriction functions accept)"
)


def _text_error(text: str) -> str | None:
    """Why ``text`` cannot be a template file (:class:`OperatorDefinition`'s rules), or None."""
    if len(text.encode("utf-8", errors="surrogatepass")) > MAX_FILE_BYTES:
        return f"over {MAX_FILE_BYTES} bytes"
    if "\x00" in text:
        return "it holds a NUL character"
    return include_error("generated source", text, advice=GENERATOR_INCLUDE_ADVICE)


def _plain(value: Any) -> Any:
    """A numpy scalar of a screened column as the Python value the table is keyed by."""
    return value.item() if isinstance(value, np.generic) else value
