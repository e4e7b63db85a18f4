"""Kernel Tuner's restriction functions (a callable ``restrictions``, or functions in the
list) in a local ``kato.tune_kernel``: called in this process, up front, with the code
generator (a string source is a generator of itself), and the configs they refuse are left
out of the operator's table. The rule: their answers are in the table, so in the version (one
version where they answer alike at every size); as Kato cannot read what a function depends
on, an operator they shaped serves exact sizes only."""

from __future__ import annotations

import pytest
from kato.kernels.spec import InvalidInput
from kato.kernels.user.generated import GeneratedOperatorSpec
from kernel_tuner.searchspace import Searchspace

import kato
from kato import kernel_tuner
from user_ops.recording import record
from user_ops.test_generated_source import (
    BIG,
    CODEGEN,
    KW,
    NO_TAIL,
    SMALL,
    TUNE,
    Counting,
    _args,
    _operator,
)


def by_names(bs, tile):
    """A plain function whose parameters are tunables' names."""
    return bs * tile <= 2048


def in_order(a, b):
    """A plain function of every tunable's value, in tune_params order."""
    return a * b <= 2048


# Kernel Tuner's forms, each on a line of its own: it reads a lambda's source.
FORMS = [
    lambda p: p["bs"] * p["tile"] <= 2048,
    [by_names],
    [in_order, "bs >= 64"],
    [lambda p: p["tile"] != 2, "bs * tile <= 4096"],
]


@pytest.mark.parametrize("form", FORMS)
def test_each_form_keeps_the_configs_kernel_tuner_keeps(form):
    """The table holds exactly the configs of Kernel Tuner's own search space for the same
    restrictions (its PythonConstraint builder, block size names and 1024 threads)."""
    gen = Counting()
    op = _operator(gen, restrictions=form)
    kt = Searchspace(TUNE, form, 1024, block_size_names=["bs"])
    assert sorted((c["bs"], c["tile"]) for c, _ in gen.calls) == sorted(kt.list)
    assert isinstance(op, GeneratedOperatorSpec) and op.generated_configs == kt.size
    assert not op.checks_every_size


def _tune(n, db, tmp_path, restrictions):
    """Tune the generator with ``restrictions`` at ``n`` on a recording of its space there."""
    op = _operator(Counting(), n=n, restrictions=restrictions)
    path, best = record(op, (n,), tmp_path / f"cache_{n}.json")
    args, answer = _args(n)
    _, env = kato.tune_kernel(
        "vector_add", Counting(), n, args, TUNE, answer=answer, cache=str(path),
        simulation_mode=True, db=db, **(KW | {"restrictions": restrictions}),
    )  # fmt: skip
    assert env["best_config"] == best and env["status"] == "done"
    return env, best


def test_a_function_of_the_config_alone_keeps_one_version(tmp_path):
    """A function reading only its config answers alike at both sizes: one version, each size
    serves its own winner, and no size serves another's (its answer there is unknown)."""
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    restrictions = [lambda p: p["tile"] != 2, *NO_TAIL["restrictions"]]
    small, small_best = _tune(SMALL, db, tmp_path, restrictions)
    big, big_best = _tune(BIG, db, tmp_path, restrictions)
    assert small["kato_operator_version"] == big["kato_operator_version"]
    for n, best in ((SMALL, small_best), (BIG, big_best)):
        found = kato.lookup("vector_add", n, gpu="H200", db=db)
        assert (found["config"], found["source"]) == (best, "exact")
    assert kato.lookup("vector_add", 2 * BIG, gpu="H200", db=db) is None


def _no_tail(n):
    """Kernel Tuner's no-tail restriction reading the problem size from its closure."""
    return lambda p: n % (p["bs"] * p["tile"]) == 0


def test_a_function_reading_the_size_from_elsewhere_is_never_served_wrong(tmp_path):
    """A function reading the size from its closure answers otherwise at each size: another
    table, another version. The newest version is served, at its own sizes only: the winner
    of the large size, invalid at the small one, is never served there."""
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    small, small_best = _tune(SMALL, db, tmp_path, ["bs * tile <= 4096", _no_tail(SMALL)])
    big, big_best = _tune(BIG, db, tmp_path, ["bs * tile <= 4096", _no_tail(BIG)])
    assert small["kato_operator_version"] != big["kato_operator_version"]
    assert SMALL % (big_best["bs"] * big_best["tile"]) != 0
    assert kato.lookup("vector_add", BIG, gpu="H200", db=db)["config"] == big_best
    assert kato.lookup("vector_add", SMALL, gpu="H200", db=db) is None
    assert kato.lookup("vector_add", 2 * BIG, gpu="H200", db=db) is None


def test_a_string_source_is_a_table_of_itself():
    """With a string source, restriction functions make the operator a table of that one
    source (stored once): each config renders as the plain string operator renders it, and a
    config a function refused is refused at every size."""
    seen = []

    def fewer_tiles(p):
        seen.append(dict(p))
        return p["tile"] <= 2

    plain = _operator(CODEGEN)
    op = _operator(CODEGEN, restrictions=[fewer_tiles, "bs * tile <= 4096"])
    assert isinstance(op, GeneratedOperatorSpec) and len(op._texts) == 1
    assert op.generated_configs == 12 and len(seen) == 23  # called on each config checks pass
    config = {"bs": 256, "tile": 2}
    assert op.render(config, (BIG,), "float32") == plain.render(config, (BIG,), "float32")
    assert "no source was generated" in op.check({"bs": 256, "tile": 4}, (BIG,), "float32")


def test_refused_functions_and_forms():
    """A function that raises names itself and the config, before the generator runs; a
    service runs no caller's Python; python-constraint objects are refused."""
    gen = Counting()

    def broken(p):
        return 1 // 0 if p["bs"] == 64 else True

    with pytest.raises(InvalidInput, match=r"function .*broken raised ZeroDivisionError for "
                       r"config \{'bs': 64, 'tile': 1\}") as caught:  # fmt: skip
        _operator(gen, restrictions=[broken])
    assert isinstance(caught.value.__cause__, ZeroDivisionError) and gen.calls == []
    args, answer = _args()
    for source in (gen, CODEGEN):
        with pytest.raises(InvalidInput, match="restriction functions run only in a local"):
            kato.tune_kernel("vector_add", source, BIG, args, TUNE, answer=answer,
                             service="http://kato.invalid", **(KW | {
                                 "restrictions": [by_names]}))  # fmt: skip
    from constraint import MaxProdConstraint

    with pytest.raises(InvalidInput, match="not MaxProdConstraint"):
        _operator(gen, restrictions=[MaxProdConstraint(4096)])
    assert gen.calls == []


def test_functions_are_called_on_a_bounded_number_of_configs(monkeypatch):
    """Functions run on at most ENUMERATE_MAX configs (refused before any call), and may
    narrow a space over MAX_GENERATED_CONFIGS to the generator's limit."""
    seen = []

    def small_tiles(p):
        seen.append(p)
        return p["tile"] == 1

    monkeypatch.setattr(kernel_tuner, "ENUMERATE_MAX", 20)
    with pytest.raises(InvalidInput, match="23 configs pass .* too many to call restriction"):
        _operator(Counting(), restrictions=[small_tiles, "bs * tile <= 4096"])
    assert seen == []
    monkeypatch.setattr(kernel_tuner, "ENUMERATE_MAX", 100)
    monkeypatch.setattr(kernel_tuner, "MAX_GENERATED_CONFIGS", 6)
    gen = Counting()
    assert _operator(gen, restrictions=[small_tiles, "bs * tile <= 4096"]).generated_configs == 6
    with pytest.raises(InvalidInput, match="12 configs pass .* and the restriction functions"):
        _operator(gen, restrictions=[lambda p: p["tile"] <= 2, "bs * tile <= 4096"])
    assert len(gen.calls) == 6
