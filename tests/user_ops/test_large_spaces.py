"""User operators with large spaces: the vectorised check agrees with the per-config one, a
3.4M-combination space is filtered whole, a larger one is sampled (or refused when too sparse),
and the search and a worker's job run on a sampled space with its warm start."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.kernels.user import OperatorDefinition, UserOperatorSpec, vector
from kato.kernels.user import expr as expr_module
from kato.tuner import space as space_module
from kato.tuner.backends.base import Backend, DeviceInfo, TrialResult, TrialStatus
from kato.tuner.backends.pycuda import check_on_gpu, operator_space
from kato.tuner.search import Budget, Search
from kato.tuner.worker import Worker

from kato.shared.gpus import find_gpu

TEMPLATE = "__global__ void k(float *out) {}\n"


def make_op(tune_params, restrictions=(), **extra) -> UserOperatorSpec:
    spec = {
        "name": "large_space_test", "template": "k.cu", "kernel_name": "k", "shape": ["n"],
        "verify": False, "tune_params": tune_params, "restrictions": list(restrictions),
        "arguments": [{"name": "out", "dtype": "float32", "size": "n", "output": True}],
        **extra,
    }  # fmt: skip
    return UserOperatorSpec(OperatorDefinition(spec=spec, files={"k.cu": TEMPLATE}))


# --- the expressions, vectorised -----------------------------------------------------------

PARAMS = {"a": [-3, 0, 1, 2, 7], "b": [0, 1, 3, 64], "f": [0.0, 0.5, -2.5], "s": ["x", "yy"]}
EXPRESSIONS = [
    "a + b * 2 - 1", "a / b", "a // b", "a % b", "f // 0.5", "f % a", "a ** b", "a ** -1",
    "2 ** a", "f ** 0.5", "b ** 0.5", "-a", "~a", "~f", "+f", "not a", "a and b", "a or f",
    "f and a or b", "a < b <= 3", "a < 1 / b < 2", "a == f", "s == 'x'", "s != a", "s < 'y'",
    "s < a", "s + a", "-s", "a in (0, 1, 'x')", "s in ('x', 2)", "f not in (0.5,)",
    "1 << b", "a >> 1", "a & b", "a | 3", "a ^ b", "f & 1", "1 << a",
    "min(a, b)", "max(a, b, 1)", "min(a, f)", "abs(a - b)", "ceil(a / 2)", "floor(f)",
    "int(f * 3)", "log2(a)", "log2(b)", "sqrt(a)", "sqrt(f)", "ceil(s)",
    "a if b else f", "b // a if a else -1", "True + True", "(a > 1) * 3", "a * 10**15 * b",
    "b * 1e308 * 10", "2 ** 60 + a",
    # Python's type is per config: an int here, a float there.
    "(f or 1) << b", "~(2 ** (a - 1))", "(f and 2) & a", "(2.5 if a > 1 else 2) | 1",
    "(a > 1) & (b > 1)", "max(f, 1e999) > a", "abs(-1e999) > a", "sqrt(1e999 * a) > 0",
    "log2(abs(-1e999)) > 0", "3 ** (a - 1) * 7 ** 19 > 0",
]  # fmt: skip


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_vectorised_expressions_answer_as_the_scalar_walk(text):
    """Every combination: failed where the scalar walk raises, else the same value (or the
    expression hands the columns back, NotVectorised: the callers then walk config by config)."""
    names = list(PARAMS)
    parsed = expr_module.parse(text, names)
    combos = list(itertools.product(*PARAMS.values()))
    columns = {k: np.array([c[i] for c in combos]) for i, k in enumerate(names)}
    try:
        values, failed = vector.evaluate(parsed, columns, len(combos))
    except vector.NotVectorised:
        # Past 2**53, or an int-only operator on a value that may be an int or a float.
        assert text in (
            "a ** b", "1 << b", "a * 10**15 * b", "2 ** 60 + a", "min(a, f)", "f & 1",
            "~f", "(f or 1) << b", "~(2 ** (a - 1))", "(f and 2) & a",
            "(2.5 if a > 1 else 2) | 1", "3 ** (a - 1) * 7 ** 19 > 0",
        ), text  # fmt: skip
        return
    for i, combo in enumerate(combos):
        env = dict(zip(names, combo, strict=True))
        try:
            expected = parsed.evaluate(env)
        except expr_module.ExpressionError:
            assert failed[i], (text, env)
            continue
        assert not failed[i], (text, env, values[i])
        got = values[i].item()
        if isinstance(expected, float) and math.isnan(expected):
            assert math.isnan(got)
        else:
            assert got == expected and bool(got) == bool(expected), (text, env, got, expected)


# --- the whole check, vectorised -----------------------------------------------------------

CONV_PARAMS = {
    "filter_height": list(range(3, 35, 2)), "filter_width": list(range(3, 35, 2)),
    "block_size_x": [16 * i for i in range(1, 10)], "block_size_y": [2**i for i in range(6)],
    "tile_size_x": list(range(1, 9)), "tile_size_y": list(range(1, 9)),
    "use_padding": [0, 1], "read_only": [0, 1],
}  # fmt: skip
CONV_RESTRICTIONS = [
    "use_padding == 0 or block_size_x % 32 != 0",
    "block_size_x * block_size_y >= 32",
    "(block_size_x * tile_size_x + filter_width - 1) * (block_size_y * tile_size_y + "
    "filter_height - 1) * 4 <= 48 * 1024",
    "tile_size_x * tile_size_y <= 32",
]


def conv_op() -> UserOperatorSpec:
    return make_op(
        CONV_PARAMS, CONV_RESTRICTIONS,
        grid_div_x=["block_size_x", "tile_size_x"],
        shared_memory="(block_size_x * tile_size_x + filter_width - 1) * 4 * read_only",
    )  # fmt: skip


@pytest.mark.parametrize(
    "sizes",
    [
        {"problem_size": ["(x > 1) & (n > 2)"]},  # a bool: not a size
        {"grid_div_x": ["(x > 1) | (x > 2)"]},
        {"grid_div_x": ["(x > 1) ^ 1"]},  # an int: a size
    ],
)
def test_the_screen_refuses_a_size_that_is_a_bool_as_the_check_does(sizes):
    op = make_op({"x": [1, 2, 4]}, **sizes)
    mask = op.screen((64,), "float32")({"x": np.array([1, 2, 4])})
    expected = [op.check({"x": x}, (64,), "float32") is None for x in (1, 2, 4)]
    assert mask.tolist() == expected


def test_a_3_4m_space_is_filtered_whole_as_the_per_config_check_counts():
    op, gpu, shape = conv_op(), find_gpu("A100"), (1 << 20,)
    space = operator_space(
        op, shape, "float32", lambda c: check_on_gpu(op, shape, "float32", gpu, c, "sm_80"), gpu
    )
    assert len(space) == 3_538_944
    mask = space.filter_mask()  # about 2 s
    # A sub-space (two filter sizes, everything else whole), config by config.
    names = list(CONV_PARAMS)
    sub = {**CONV_PARAMS, "filter_height": [3, 33], "filter_width": [17], "tile_size_y": [1, 8]}
    positions, expected = [], []
    for combo in itertools.product(*sub.values()):
        config = dict(zip(names, combo, strict=True))
        index = [CONV_PARAMS[k].index(v) for k, v in config.items()]
        positions.append(np.ravel_multi_index(index, [len(v) for v in CONV_PARAMS.values()]))
        expected.append(check_on_gpu(op, shape, "float32", gpu, config, "sm_80") is None)
    assert mask[positions].tolist() == expected
    assert 0 < sum(expected) < len(expected)  # the restrictions and the limits both bite
    assert space.count_valid() == int(mask.sum())
    assert space.sampled  # over ENUMERATE_MAX valid: the search gets a pool
    pool = space.valid_configs()
    assert len(pool) == space_module.POOL_SIZE
    assert len({space.key(c) for c in pool}) == len(pool)
    assert all(space.check(c) is None for c in pool[::500])


def test_a_space_too_large_to_filter_is_sampled_and_a_too_sparse_one_refused(monkeypatch):
    monkeypatch.setattr(space_module, "MAX_DRAWS", 1 << 19)
    wide = {f"p{i}": list(range(16)) for i in range(8)}  # 4.3e9 combinations
    op = make_op(wide, ["p0 + p1 + p2 < 20", "p3 * p4 % 3 != 1"])
    space = operator_space(op, (1000,), "float32", lambda c: op.check(c, (1000,), "float32"))
    assert len(space) > space_module.FILTER_MAX and space.sampled
    assert space.count_valid() is None
    drawn = space.sample(500, seed=3)
    assert len(drawn) == 500 and len({space.key(c) for c in drawn}) == 500
    assert all(op.check(c, (1000,), "float32") is None for c in drawn)
    assert drawn == space.sample(500, seed=3)  # the same pool in every process
    sparse = make_op(wide, ["p0 + p1 + p2 + p3 + p4 + p5 == 0"])
    space = operator_space(sparse, (1000,), "float32", lambda c: None)
    with pytest.raises(space_module.SpaceTooSparse, match="too few to sample"):
        space.valid_configs()


def test_spec_accepts_spaces_past_a_million():
    assert make_op(CONV_PARAMS).space_size() == 3_538_944


# --- the search and a job on a sampled space -----------------------------------------------


def synthetic_ms(config) -> float:
    threads = config["block_size_x"] * config["block_size_y"]
    return 1.0 + abs(math.log2(threads / 256)) + 0.3 * abs(config["tile_size_x"] - 4)


def evaluate(config) -> TrialResult:
    return TrialResult(config=dict(config), status=TrialStatus.OK, times_ms=[synthetic_ms(config)])


@pytest.fixture(scope="module")
def conv_space():
    """One space for the module (filtered once): a search only adds to its pool."""
    op, gpu, shape = conv_op(), find_gpu("H200"), (1 << 20,)
    check = lambda c: check_on_gpu(op, shape, "float32", gpu, c, "sm_90")  # noqa: E731
    space = operator_space(op, shape, "float32", check, gpu)
    return op, shape, lambda: space


def test_warm_start_outside_the_pool_is_measured_first_and_searched_around(conv_space):
    op, shape, build = conv_space
    space = build()
    pool_keys = {space.key(c) for c in space.valid_configs()}
    seed = next(
        c for c in (dict(zip(CONV_PARAMS, v, strict=True)) for v in itertools.product(
            *CONV_PARAMS.values()))
        if space.key(c) not in pool_keys and space.check(c) is None
    )  # fmt: skip
    search = Search(space, evaluate, seed=1, seed_configs=[seed])
    result = search.run(Budget(max_configs=16))
    measured = list(search.results)
    assert measured[0] == space.key(seed)
    assert len(measured) == 16 and result.best is not None
    neighbours = [c for c in space.valid_configs() if sum(c[k] != seed[k] for k in seed) == 1]
    assert len(neighbours) > 10  # the seed's valid neighbours joined the pool
    assert all(space.check(r.config) is None for r in search.results.values())


class SyntheticBackend(Backend):
    """A CPU backend over a user operator's real space (its vectorised check), with a synthetic
    time per config."""

    name = "synthetic"

    def __init__(self, build):
        self._space = build()

    def device(self) -> DeviceInfo:
        return DeviceInfo("test", "H200", (9, 0), "13.0")

    def space(self):
        return self._space

    def evaluate(self, config) -> TrialResult:
        return evaluate(config)


def test_a_job_tunes_a_sampled_space_within_its_budget(conv_space, tmp_path):
    op, shape, build = conv_space
    url = f"sqlite:///{tmp_path}/kato.db"
    sessions = session_factory(init_db(url))
    with sessions() as s:
        job = queries.create_job(
            s, operator=op.name, operator_version=op.version, shape=list(shape),
            dtype="float32", gpu_model="H200", budget_configs=16,
        )  # fmt: skip
        job_id = job.id
    backend = SyntheticBackend(build)
    worker = Worker(sessions, url, ["H200"], lambda job: backend, poll_seconds=0.01)
    assert worker.run_once().status == "done"
    with sessions() as s:
        trials = queries.job_trials(s, job_id)
        job = queries.get_job(s, job_id)
    assert len(trials) == 16 and len({t.config_key for t in trials}) == 16
    assert all(t.status == "ok" for t in trials)
    assert job.best_time_ms == min(t.time_ms for t in trials)


def test_brute_force_on_a_sampled_space_is_a_budgeted_search_filtered_once(tmp_path, monkeypatch):
    """``kato.tune_kernel``'s default (brute_force) on a space of over ENUMERATE_MAX valid
    configs runs the default search at ``max_fevals``, with a warning; the space is filtered
    once, by the backend the job runs on (not first by tune_kernel to decide)."""
    from kato.kernels import get_operator
    from kato.tuner.backends import isolated

    import kato

    screened: list[int] = []
    screen = UserOperatorSpec.screen

    def counted(self, *args, **kwargs):
        screened.append(1)
        return screen(self, *args, **kwargs)

    def synthetic_backend(spec, isolate, trial_timeout_s):
        op, gpu = get_operator(spec.operator), find_gpu("H200")
        check = lambda c: check_on_gpu(op, spec.shape, spec.dtype, gpu, c, "sm_90")  # noqa: E731
        return SyntheticBackend(lambda: operator_space(op, spec.shape, spec.dtype, check, gpu))

    monkeypatch.setattr(UserOperatorSpec, "screen", counted)
    monkeypatch.setattr(isolated, "measuring_backend", synthetic_backend)
    n = 1 << 16
    tune_params = {
        "block_size_x": [32 * i for i in range(1, 33)], "block_size_y": [1, 2, 4, 8],
        "tile_size_x": list(range(1, 9)), "f": list(range(256)),
    }  # fmt: skip
    restrictions = ["block_size_x * block_size_y <= 1024"]  # 122,880 valid of 262,144
    with pytest.warns(UserWarning, match="too many to measure every one"):
        results, env = kato.tune_kernel(
            "k", TEMPLATE, n, [np.zeros(n, np.float32)], tune_params,
            restrictions=restrictions, strategy_options={"max_fevals": 6},
            db=f"sqlite:///{tmp_path / 'kato.db'}", name="sampled_brute_force", quiet=True,
        )  # fmt: skip
    assert env["strategy"] == "forest" and env["budget"] == 6 and len(results) == 6
    assert env["status"] == "done" and screened == [1]
