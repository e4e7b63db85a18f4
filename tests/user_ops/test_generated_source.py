"""``kato.tune_kernel`` with a code generator as ``kernel_source`` (Kernel Tuner's
``vector_add_codegen.py``, and a Jinja2 template's bound ``render`` in ``vector_add_jinja.py``):
the generator runs in this process only, once per valid config, and the operator holds its
sources as data (``kernels.user.generated``)."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil

import numpy as np
import pytest
from kato.kernels.registry import register
from kato.kernels.spec import InvalidInput
from kato.kernels.user.generated import MAX_GENERATED_CONFIGS, GeneratedOperatorSpec
from kato.tuner.backends.isolated import BackendSpec, IsolatedBackend

import kato
from kato.kernel_tuner import operator_from_arguments
from user_ops.recording import record
from user_ops.test_tune_kernel import N

# A tiled vector add whose block size and tile count are written into the code (Kernel
# Tuner's codegen example does this with the block size), with a tunable block size name.
CODEGEN = """
__global__ void vector_add(float *c, float *a, float *b, int n) {
    int i = blockIdx.x * %(bs)d * %(tile)d + threadIdx.x;
    for (int t = 0; t < %(tile)d; t++, i += %(bs)d) {
        if (i < n) c[i] = a[i] + b[i];
    }
}
"""
TUNE = {"bs": [32, 64, 128, 256, 512, 1024], "tile": [1, 2, 4, 8]}
KW = {
    "block_size_names": ["bs"],
    "grid_div_x": ["bs", "tile"],
    "restrictions": ["bs * tile <= 4096"],
}
VALID = 23  # 24 combinations less 1024 x 8

# Kernel Tuner's examples/cuda/vector_add_jinja.cu, as its vector_add_jinja2.py renders it.
JINJA = """
{% set real_vector = real_type ~ vector_size %}
#define float1 float

__global__ void vector_add(const {{ real_vector }} * __restrict__ a, const {{ real_vector }} * __restrict__ b, {{ real_vector }} * __restrict__ c, int size)
{
    int index = (blockIdx.x * {{ block_size_x }} * {{ tiling_x }}) + threadIdx.x;

    {% for tile in range(tiling_x) %}
    {% set offset = block_size_x * tile %}
    if ( index + {{ offset }} < (size / {{ vector_size }}) )
    {
        {{ real_vector }} item_a = a[index + {{ offset }}];
        {{ real_vector }} item_b = b[index + {{ offset }}];

        {% if vector_size == 1 %}
        c[index + {{ offset }}] =  item_a + item_b;
        {% elif vector_size == 2 %}
        c[index + {{ offset }}] =  make_{{ real_vector }}(item_a.x + item_b.x, item_a.y + item_b.y);
        {% elif vector_size == 4 %}
        c[index + {{ offset }}] =  make_{{ real_vector }}(item_a.x + item_b.x, item_a.y + item_b.y, item_a.z + item_b.z, item_a.w + item_b.w);
        {% endif %}
    }
    {% endfor %}
}
"""  # noqa: E501


class Counting:
    """A generator (any callable) that records each call's params and pid, and refuses to be
    pickled: an operator that kept it could not be sent to the measuring child."""

    def __init__(self, text=CODEGEN, fail_on=None, returns=str):
        self.text, self.fail_on, self.returns = text, fail_on, returns
        self.calls: list[tuple[dict, int]] = []

    def __call__(self, params):
        self.calls.append((dict(params), os.getpid()))
        if self.fail_on is not None and params["bs"] == self.fail_on:
            return 1 // 0
        if self.returns is not str:  # a non-string return, None included
            return self.returns
        return self.text % params

    def __reduce__(self):
        raise TypeError("a code generator is never pickled")


class Template:
    """Jinja2's ``Template`` in miniature: its bound ``render`` takes the params dict."""

    def __init__(self, text):
        self.text = text

    def render(self, params):
        return self.text % params


def _args(n=N):
    a = np.ones(n, np.float32)
    return [np.zeros_like(a), a, a, np.int32(n)], [2 * a, None, None, None]


def _operator(source, tune=TUNE, n=N, **kw):
    args, answer = _args(n)
    op, _ = operator_from_arguments("vector_add", source, n, args, tune, answer=answer,
                                    **(KW | kw))  # fmt: skip
    return op


def _configs():
    return [{"bs": bs, "tile": t} for bs in TUNE["bs"] for t in TUNE["tile"] if bs * t <= 4096]


def test_each_config_renders_what_its_generated_string_would():
    """The generator is called once per valid config, in tune_params order, with a dict of the
    tunables; render(config) is Kato's rendering of exactly that source (Kernel Tuner's macros
    under block_size_names, the grid by grid_div_x, extern "C"), as a string source of the
    same text renders it, and the launch is the same."""
    gen = Counting()
    op = _operator(gen)
    assert isinstance(op, GeneratedOperatorSpec) and op.generated_configs == VALID
    assert [params for params, _ in gen.calls] == _configs()
    assert {pid for _, pid in gen.calls} == {os.getpid()}
    for config in _configs():
        fixed = _operator(CODEGEN % config)
        source = op.render(config, (N,), "float32")
        assert source == fixed.render(config, (N,), "float32")
        assert source.endswith('extern "C" {\n' + CODEGEN % config + "\n}\n")
        assert f"#define bs {config['bs']}\n" in source
        assert f"#define grid_size_x {-(-N // (config['bs'] * config['tile']))}\n" in source
        assert op.launch(config, (N,), "float32") == fixed.launch(config, (N,), "float32")
    assert len(gen.calls) == VALID  # rendering asks the table, not the generator
    assert "does not hold" in op.check({"bs": 1024, "tile": 8}, (N,), "float32")
    with pytest.raises(InvalidInput, match="no source was generated"):
        op.render({"bs": 1024, "tile": 8}, (N,), "float32")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_generated_sources_compile_with_nvcc(tmp_path):
    """What the backend compiles (its compile_config: render, then nvcc) for generated
    variants: Kernel Tuner's codegen example, and its Jinja2 template where jinja2 imports."""
    from kato.tuner.backends.pycuda import compile_config

    op = _operator(Counting())
    for config in ({"bs": 64, "tile": 1}, {"bs": 256, "tile": 8}):
        compiled = compile_config(op, (N,), "float32", config, "sm_90", compile_cache=tmp_path)
        assert compiled.cubin and compiled.registers is not None
    jinja2 = pytest.importorskip("jinja2")
    op = _jinja_operator(jinja2.Template(JINJA).render)
    for vector_size in (1, 2, 4):
        config = {"real_type": "float", "block_size_x": 128, "vector_size": vector_size,
                  "tiling_x": 3}  # fmt: skip
        compiled = compile_config(op, (N,), "float32", config, "sm_90", compile_cache=tmp_path)
        assert compiled.cubin


def _jinja_operator(render, tiling=(1, 2, 3)):
    """Kernel Tuner's vector_add_jinja2.py call (a smaller space): string tunables too."""
    a = np.ones(N, np.float32)
    op, _ = operator_from_arguments(
        "vector_add", render, N, [a, a, np.zeros_like(a), np.int32(N)],
        {"real_type": ["float"], "block_size_x": [32, 128], "vector_size": [1, 2, 4],
         "tiling_x": list(tiling)},
        grid_div_x=["block_size_x * vector_size * tiling_x"], answer=[None, None, 2 * a, None],
    )  # fmt: skip
    return op


def test_a_bound_render_method_is_a_generator():
    """vector_add_jinja.py passes ``Template(...).render``: a bound method works as a
    function does, with the same sources and version."""
    template = Template(CODEGEN)
    by_method = _operator(template.render)
    by_function = _operator(lambda params: CODEGEN % params)
    assert by_method.version == by_function.version
    config = {"bs": 128, "tile": 4}
    assert by_method.render(config, (N,), "float32") == by_function.render(config, (N,), "float32")


def test_jinja2_templates_render_as_kernel_tuner_renders_them():
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Template(JINJA)
    op = _jinja_operator(template.render)
    assert op.generated_configs == 2 * 3 * 3
    config = {"real_type": "float", "block_size_x": 32, "vector_size": 4, "tiling_x": 2}
    source = op.render(config, (N,), "float32")
    assert template.render(config) in source
    assert "make_float4(item_a.x + item_b.x" in source and "index + 32 <" in source
    assert "#define real_type float\n" in source
    assert f"#define grid_size_x {-(-N // (32 * 4 * 2))}\n" in source


def test_the_version_follows_the_generated_sources():
    """The version hashes every source the generator gave: the same sources from another
    callable are the same version, another source for one config is another; a problem size
    with the same valid configs keeps it (results cross sizes)."""
    base = _operator(Counting()).version
    assert _operator(Template(CODEGEN).render).version == base
    assert _operator(Counting(), n=N * 2).version == base

    def one_differs(params):
        extra = "// tuned\n" if params == {"bs": 64, "tile": 2} else ""
        return extra + CODEGEN % params

    assert _operator(one_differs).version != base
    assert _operator(lambda p: CODEGEN % p + " ").version != base


def test_the_table_holds_every_size_and_each_size_checks_its_own():
    """The table is built from the checks holding at every size: a restriction naming x is
    left to each size's check, so a small size generates the configs only a larger one allows,
    refuses them by that restriction (not by the table), and is the larger size's version."""
    gen = Counting()
    tune = {"bs": [32, 64, 128, 256], "tile": [1]}
    op = _operator(gen, tune=tune, n=128, restrictions=["bs <= x"])
    assert op.generated_configs == 4 and [c["bs"] for c, _ in gen.calls] == tune["bs"]
    small, big = (128,), (1024,)
    assert "restriction bs <= x does not hold" in op.check({"bs": 256, "tile": 1}, small, "float32")
    assert op.check({"bs": 256, "tile": 1}, big, "float32") is None
    columns = {"bs": np.array(tune["bs"]), "tile": np.array([1, 1, 1, 1])}
    assert op.screen(small, "float32")(columns).tolist() == [True, True, True, False]
    assert op.screen(big, "float32")(columns).tolist() == [True] * 4
    assert op.render({"bs": 256, "tile": 1}, big, "float32").endswith(
        'extern "C" {\n' + CODEGEN % {"bs": 256, "tile": 1} + "\n}\n"
    )
    assert _operator(Counting(), tune=tune, n=1024, restrictions=["bs <= x"]).version == op.version


def test_configs_outside_the_table_are_refused_at_every_size():
    """A table without a config (refused at every size; here one built without it) refuses it
    in check, check_any_size and the screens, and render raises: there is no generator to ask."""
    op = _operator(Counting(), tune={"bs": [32, 64, 128, 256], "tile": [1]})
    partial = GeneratedOperatorSpec(
        op.definition, [(c, op.source_for(c)) for c in ({"bs": 32, "tile": 1},
                                                        {"bs": 64, "tile": 1})],
    )  # fmt: skip
    config = {"bs": 128, "tile": 1}
    assert op.check(config, (N,), "float32") is None
    assert "no source was generated" in partial.check(config, (N,), "float32")
    assert "no source was generated" in partial.check_any_size(config, "float32")
    columns = {"bs": np.array([32, 64, 128, 256]), "tile": np.array([1, 1, 1, 1])}
    assert partial.screen((N,), "float32")(columns).tolist() == [True, True, False, False]
    assert partial.screen_any_size("float32")(columns).tolist() == [True, True, False, False]
    assert partial.default_config((N,), "float32") == {"bs": 32, "tile": 1}
    with pytest.raises(InvalidInput, match="bs': 128.*no source was generated"):
        partial.render(config, (N,), "float32")


def test_too_many_configs_are_refused_before_the_generator_runs():
    gen = Counting()
    tune = {"bs": [32, 64], "tile": list(range(1, 101)), "u": list(range(51))}
    with pytest.raises(InvalidInput, match=r"10200 configs pass the restrictions and limits that "
                       r"hold at every problem size; .*at most 10000: narrow tune_params or add "
                       r"restrictions"):  # fmt: skip
        _operator(gen, tune=tune, restrictions=[])
    huge = {"bs": [32, 64], "tile": list(range(1, 1025)), "u": list(range(1024)),
            "v": list(range(64))}  # fmt: skip
    with pytest.raises(InvalidInput, match="too many to count the valid ones"):
        _operator(gen, tune=huge, restrictions=[])
    args, answer = _args()
    with pytest.raises(InvalidInput, match="10200 configs pass"):
        kato.tune_kernel("vector_add", gen, N, args, tune, answer=answer, **(KW | {
            "restrictions": []}))  # fmt: skip
    assert gen.calls == []
    # Restricted to the limit, it runs.
    op = _operator(gen, tune=tune, restrictions=["u < 50"])
    assert op.generated_configs == MAX_GENERATED_CONFIGS


@pytest.mark.parametrize(
    ("gen", "says"),
    [
        (Counting(fail_on=64), r"raised ZeroDivisionError for config \{'bs': 64, 'tile': 1\}: "),
        (Counting(returns=None), r"returned a NoneType for config \{'bs': 32, 'tile': 1\}"),
        (Counting(returns=b"__global__ void k() {}"), "returned a bytes for config"),
        (Counting(text='#include "mine.h"\n' + CODEGEN),
         r"source generated for config \{'bs': 32, 'tile': 1\}: .*mine\.h.*; a generated "
         r"source has no headers: have the generator put the header's text into the source"),
        (Counting(text=CODEGEN + "\x00"), "holds a NUL character"),
    ],
)  # fmt: skip
def test_a_generator_that_fails_names_the_config(gen, says):
    with pytest.raises(InvalidInput, match=says) as caught:
        _operator(gen)
    if gen.fail_on is not None:
        assert isinstance(caught.value.__cause__, ZeroDivisionError)  # its traceback kept
    if gen.returns is not str:
        assert len(gen.calls) == 1  # refused at its first call, not after every config's


def test_a_generator_is_refused_through_a_service():
    """A service's workers run no caller's Python: refused before anything is sent, without
    calling the generator."""
    gen = Counting()
    args, answer = _args()
    with pytest.raises(InvalidInput, match="generators run only in a local kato.tune_kernel"):
        kato.tune_kernel("vector_add", gen, N, args, TUNE, answer=answer,
                         service="http://kato.invalid", **KW)  # fmt: skip
    with pytest.raises(InvalidInput, match="generators run only in a local kato.tune_kernel"):
        operator_from_arguments("vector_add", [gen], N, args, TUNE, fixed=False, **KW)
    assert gen.calls == []


def test_the_operator_holds_sources_not_the_generator():
    """The operator pickles though its generator cannot (a lambda, an object refusing it), and
    what comes back renders and versions the same: only data travels."""
    for gen in (Counting(), lambda params: CODEGEN % params):
        op = _operator(gen)
        copy = pickle.loads(pickle.dumps(op))
        assert copy.version == op.version
        config = {"bs": 512, "tile": 2}
        assert copy.render(config, (N,), "float32") == op.render(config, (N,), "float32")


def test_the_measuring_child_renders_the_parents_sources_without_the_generator():
    """The isolated child (a spawned process) gets the operator registered here and renders
    each config's source from the table, byte for byte the parent's; the generator ran only
    here, before the child started, once per valid config."""
    gen = Counting()
    args, answer = _args()
    op, _ = operator_from_arguments("vector_add_generated", gen, N, args, TUNE, answer=answer,
                                    **KW)  # fmt: skip
    register(op)
    backend = IsolatedBackend(
        BackendSpec(kind="user_ops.child_backend:make_render_echo", operator=op.name,
                    shape=(N,), dtype="float32"),
        trial_timeout_s=60,
    )  # fmt: skip
    try:
        for config in ({"bs": 32, "tile": 8}, {"bs": 1024, "tile": 4}):
            result = backend.evaluate(config)
            assert result.ok, result.error
            expected = op.render(config, (N,), "float32")
            assert result.error == hashlib.sha256(expected.encode()).hexdigest()
            assert result.times_ms[0] != os.getpid()  # rendered in the child
    finally:
        backend.close()
    assert len(gen.calls) == VALID and {pid for _, pid in gen.calls} == {os.getpid()}


def test_tune_kernel_with_a_generator_replays_and_serves_its_winner(tmp_path):
    """The whole local path with a generator, on the replay backend (Kernel Tuner's
    simulation mode): every valid config measured, the winner stored and served by
    kato.lookup, under the generated operator's version."""
    op = _operator(Counting())
    path, best = record(op, (N,), tmp_path / "vector_add.json")
    args, answer = _args()
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    results, env = kato.tune_kernel(
        "vector_add", Template(CODEGEN).render, N, args, TUNE, answer=answer,
        cache=str(path), simulation_mode=True, db=db, **KW,
    )  # fmt: skip
    assert len(results) == VALID and all(isinstance(r["time"], float) for r in results)
    assert env["best_config"] == best and env["kato_operator_version"] == op.version
    found = kato.lookup("vector_add", N, gpu="H200", db=db)
    assert found["config"] == best and found["version"] == op.version


def test_a_str_subclass_is_kept_as_a_plain_str():
    """A generator may return a str subclass (markupsafe's Markup; a class of its own, here
    one defined in a function, which does not pickle): the table holds exact str, so the
    operator still pickles to the measuring child and nothing of the caller's code travels."""

    class Source(str):
        pass

    op = _operator(lambda params: Source(CODEGEN % params))
    config = {"bs": 64, "tile": 2}
    assert type(op.source_for(config)) is str and op.source_for(config) == CODEGEN % config
    copy = pickle.loads(pickle.dumps(op))
    assert copy.render(config, (N,), "float32") == op.render(config, (N,), "float32")
    assert op.version == _operator(Counting()).version


def test_a_generator_that_mutates_its_params_changes_nothing_else():
    """Each call gets a fresh dict: a generator that writes into it (or removes a tunable)
    changes neither the next call's params nor the config its source is filed under."""
    seen = []

    def mutating(params):
        seen.append(dict(params))
        text = CODEGEN % params
        params["bs"] = 0
        params.pop("tile")
        return text

    op = _operator(mutating)
    assert seen == _configs()
    for config in _configs():
        assert op.source_for(config) == CODEGEN % config


def test_the_table_is_bounded_in_bytes(monkeypatch):
    """The table travels whole to each measuring child: over MAX_GENERATED_BYTES of distinct
    sources is refused, naming the config where it went over; identical sources count once."""
    from kato.kernels.user import generated

    one = len((CODEGEN % {"bs": 32, "tile": 1}).encode())
    monkeypatch.setattr(generated, "MAX_GENERATED_BYTES", 3 * one + 2)
    with pytest.raises(InvalidInput, match=r"over \d+ bytes in all \(at config \{'bs': 32, 't"):
        _operator(Counting())
    assert _operator(lambda params: CODEGEN % {"bs": 32, "tile": 1}).generated_configs == VALID


def test_every_config_a_table_may_hold_is_enumerated_not_sampled():
    """The table is built from the space's valid configs; a space of more than ENUMERATE_MAX
    is sampled, which would leave configs out of the table silently."""
    from kato.kernels.user.generated import MAX_GENERATED_CONFIGS
    from kato.tuner.space import ENUMERATE_MAX

    assert MAX_GENERATED_CONFIGS <= ENUMERATE_MAX


# Kernel Tuner's "no tail" restriction: a block's tile must divide the problem, so the configs
# valid at 3 * 1024 (bs * tile up to 1024) are not those valid at 2**20 (up to 4096).
NO_TAIL = {"restrictions": ["bs * tile <= 4096", "x % (bs * tile) == 0"]}
SMALL, BIG = 3 * 1024, N
BETWEEN = N + 2048  # nearest BIG; x % 4096 == 2048: BIG's winner is invalid here


def _tune_at(n, db, tmp_path, gen=None):
    """Tune the generator at ``n`` on a recording of its space there; (env, best config)."""
    op = _operator(Counting(), n=n, **NO_TAIL)
    path, best = record(op, (n,), tmp_path / f"cache_{n}.json")
    args, answer = _args(n)
    _, env = kato.tune_kernel(
        "vector_add", gen or Counting(), n, args, TUNE, answer=answer, cache=str(path),
        simulation_mode=True, db=db, **(KW | NO_TAIL),
    )  # fmt: skip
    assert env["best_config"] == best and env["status"] == "done"
    return env, best


def test_two_sizes_with_other_valid_configs_are_one_version(tmp_path):
    """A restriction naming x makes the valid configs differ between two sizes; the generator
    tuned at both is one operator version (its table the same), each size's lookup serves its
    own winner, and a winner invalid at a size is never served there (the nearest size's
    winner is checked against the operator)."""
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    small_gen, big_gen = Counting(), Counting()
    small, small_best = _tune_at(SMALL, db, tmp_path, small_gen)
    big, big_best = _tune_at(BIG, db, tmp_path, big_gen)
    assert small["kato_operator_version"] == big["kato_operator_version"]
    assert [c for c, _ in small_gen.calls] == [c for c, _ in big_gen.calls] == _configs()
    op = _operator(Counting(), n=SMALL, **NO_TAIL)
    assert op.check(big_best, (BIG,), "float32") is None
    assert "does not hold" in op.check(big_best, (SMALL,), "float32")
    assert small_best != big_best
    version = big["kato_operator_version"]
    for n, best in ((SMALL, small_best), (BIG, big_best)):
        found = kato.lookup("vector_add", n, gpu="H200", db=db)
        assert (found["config"], found["source"], found["version"]) == (best, "exact", version)
    # Nearest BIG, where BIG's winner does not divide the size: the next nearest valid winner.
    assert "does not hold" in op.check(big_best, (BETWEEN,), "float32")
    near = kato.lookup("vector_add", BETWEEN, gpu="H200", db=db)
    assert near["source"] == "nearest" and near["config"] == small_best
    assert op.check(near["config"], (BETWEEN,), "float32") is None
    # Where the nearest winner is valid, it is served.
    assert kato.lookup("vector_add", 2 * BIG, gpu="H200", db=db)["config"] == big_best


def test_a_process_that_did_not_tune_the_kernel_serves_exact_sizes_only(tmp_path, monkeypatch):
    """kato.lookup checks a nearest size's winner against the operator this process tuned;
    without it (another process) nothing says the winner is valid here: exact sizes only."""
    from kato import tune

    db = f"sqlite:///{tmp_path / 'kato.db'}"
    _, big_best = _tune_at(BIG, db, tmp_path)
    assert kato.lookup("vector_add", 2 * BIG, gpu="H200", db=db)["source"] == "nearest"
    monkeypatch.setattr(tune, "_TUNED", {})
    assert kato.lookup("vector_add", BIG, gpu="H200", db=db)["config"] == big_best
    assert kato.lookup("vector_add", 2 * BIG, gpu="H200", db=db) is None


def test_a_slow_generator_prints_how_far_it_is(tmp_path, monkeypatch, capsys):
    """tune_kernel prints a slow generator's progress as it prints its other news (kato:
    lines, every PROGRESS_EVERY_S, then once when done), nothing for a fast one or when
    quiet; progress is told after each source."""
    from kato import tune

    told = []
    _operator(Counting(), progress=lambda done, total: told.append((done, total)))
    assert told == [(i, VALID) for i in range(1, VALID + 1)]
    path, _ = record(_operator(Counting()), (N,), tmp_path / "cache.json")
    args, answer = _args()

    def run(quiet):
        kato.tune_kernel("vector_add", Counting(), N, args, TUNE, answer=answer, quiet=quiet,
                         cache=str(path), simulation_mode=True,
                         db=f"sqlite:///{tmp_path / 'kato.db'}", **KW)  # fmt: skip
        return capsys.readouterr().out.splitlines()

    assert run(quiet=False) == []  # a fast generator
    monkeypatch.setattr(tune, "PROGRESS_EVERY_S", 0.0)
    assert run(quiet=True) == []
    lines = run(quiet=False)
    assert len(lines) == VALID and lines[0].startswith("kato: vector_add: generated 1 of 23 ")
    assert lines[-1].startswith(f"kato: vector_add: generated {VALID} sources in ")
