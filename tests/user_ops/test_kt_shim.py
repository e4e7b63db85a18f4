"""A Kernel Tuner script run unchanged, once by Kernel Tuner and once with its tune_kernel made
Kato's (benchmarks/kt_examples.py --kt-scripts), both in simulation mode on one recorded cache
file: the same configs measured and the same winner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kato.kernel_tuner import operator_from_arguments
from user_ops.recording import record
from user_ops.test_tune_kernel import KERNEL, N, _problem

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import numpy as np
from kernel_tuner import tune_kernel

n = 1 << 20
rng = np.random.default_rng(0)
a = rng.standard_normal(n).astype(np.float32)
b = rng.standard_normal(n).astype(np.float32)
tune_params = {"block_size_x": [32, 64, 128, 256, 512, 1024], "tile_size_x": [1, 2, 4, 8]}
results, env = tune_kernel(
    "vector_add", open("kernel.cu").read(), n, [np.zeros_like(a), a, b, np.int32(n)],
    tune_params, grid_div_x=["block_size_x", "tile_size_x"],
    restrictions=["block_size_x * tile_size_x <= 4096"], cache="cache.json",
    simulation_mode=True, verbose=True,
)
print(len(results))
"""


def _bench():
    """``benchmarks/kt_examples.py`` as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "kt_bench", ROOT / "benchmarks" / "kt_examples.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script_and_bench(tmp_path):
    """The script, its kernel, a recorded cache of every config and its best config
    (``best.json``) in ``tmp_path``; the benchmark module."""
    args, tune_params, kw = _problem()
    op, _ = operator_from_arguments("vector_add", KERNEL, N, args, tune_params, **kw)
    _, best = record(op, (N,), tmp_path / "cache.json")
    (tmp_path / "best.json").write_text(json.dumps(best))
    (tmp_path / "kernel.cu").write_text(KERNEL)
    (tmp_path / "script.py").write_text(SCRIPT)
    return _bench()


def test_a_kernel_tuner_script_runs_unchanged_through_kato(tmp_path):
    module = _script_and_bench(tmp_path)
    best = json.loads((tmp_path / "best.json").read_text())
    runs = module.run_scripts(tmp_path, ["script.py"], timeout=300)["script.py"]
    by_tool = {run["tool"]: run for run in runs}
    for tool in ("kt", "kato"):
        run = by_tool[tool]
        assert run["returncode"] == 0, run["output_tail"]
        (call,) = run["calls"]
        assert call["measured"] == 23 and call["failed"] == 0 and call["failures"] == []
        assert call["best_config"] == best
        assert isinstance(call["compile_s"], float) and call["compile_s"] >= 0.0


def test_a_script_budget_replaces_the_brute_force_on_both_sides(tmp_path):
    """``--script-budget``: a script that names no strategy measures that many configs with
    each tool (Kernel Tuner's random sampling, Kato's default search), not all 23."""
    module = _script_and_bench(tmp_path)
    runs = module.run_scripts(tmp_path, ["script.py"], timeout=300, max_fevals=10)["script.py"]
    for run in runs:
        assert run["returncode"] == 0, run["output_tail"]
        (call,) = run["calls"]
        assert call["max_fevals"] == 10
        assert call["measured"] == 10 and call["failed"] == 0


def test_a_script_cut_by_its_timeout_keeps_what_it_printed(tmp_path):
    """A run past ``timeout`` is reported as cut (no return code), with the output it printed
    before the cut: where its time went."""
    (tmp_path / "script.py").write_text(
        "import sys, time\nprint('tuning the first kernel', flush=True)\ntime.sleep(60)\n"
    )
    module = _bench()
    runs = module.run_scripts(tmp_path, ["script.py"], timeout=8)["script.py"]
    assert [run["tool"] for run in runs] == ["kt", "kato"]
    for run in runs:
        assert run["returncode"] is None and run["calls"] == []
        assert "tuning the first kernel" in run["output_tail"]
        assert run["output_tail"].endswith("timed out after 8 s")


def test_each_tools_best_of_a_call_is_measured_again_on_katos_timer(tmp_path):
    """``--script-retime``: after each call of Kato's run, Kato's best config and Kernel
    Tuner's best config of the same call are measured again by Kato, so that both winners are
    compared on one timer (on a replay: the recorded time of each tool's own best)."""
    module = _script_and_bench(tmp_path)
    kt, kato = module.run_scripts(tmp_path, ["script.py"], timeout=300, max_fevals=5, retime=True)[
        "script.py"
    ]
    assert "retimed" not in kt["calls"][0]
    (call,) = kato["calls"]
    retimed = call["retimed"]
    assert retimed["kato"]["config"] == call["best_config"]
    assert retimed["kt"]["config"] == kt["calls"][0]["best_config"]
    assert retimed["kato"]["ms"] == pytest.approx(call["best_time_own_ms"])
    assert retimed["kt"]["ms"] == pytest.approx(kt["calls"][0]["best_time_own_ms"])


# Kernel Tuner's vector_add_codegen.py in the shape of SCRIPT: a code generator (Kernel Tuner
# asks for lang= with one) whose source writes the block size into the code.
CODEGEN_SCRIPT = """
import numpy as np
from kernel_tuner import tune_kernel

KERNEL = open("kernel.cu").read()


def my_fancy_generator(params):
    return "// block %d\\n" % params["block_size_x"] + KERNEL


n = 1 << 20
a = np.ones(n, np.float32)
tune_params = {"block_size_x": [32, 64, 128, 256, 512, 1024], "tile_size_x": [1, 2, 4, 8]}
results, env = tune_kernel(
    "vector_add", my_fancy_generator, n, [np.zeros_like(a), a, a, np.int32(n)], tune_params,
    grid_div_x=["block_size_x", "tile_size_x"], lang="CUDA",
    restrictions=["block_size_x * tile_size_x <= 4096"], cache="cache.json",
    simulation_mode=True,
)
"""


def test_a_code_generator_script_runs_unchanged_through_kato(tmp_path):
    """Kernel Tuner's codegen example's way (kernel_source a function) runs through Kato as
    through Kernel Tuner: the same configs, the same winner."""
    args, tune_params, kw = _problem()
    op, _ = operator_from_arguments(
        "vector_add", lambda p: f"// block {p['block_size_x']}\n" + KERNEL, N, args,
        tune_params, **kw,
    )  # fmt: skip
    _, best = record(op, (N,), tmp_path / "cache.json")
    (tmp_path / "kernel.cu").write_text(KERNEL)
    (tmp_path / "codegen.py").write_text(CODEGEN_SCRIPT)
    runs = _bench().run_scripts(tmp_path, ["codegen.py"], timeout=300)["codegen.py"]
    for run in runs:
        assert run["returncode"] == 0, run["output_tail"]
        (call,) = run["calls"]
        assert call["measured"] == 23 and call["failed"] == 0
        assert call["best_config"] == best


def test_the_generator_examples_are_runnable_scripts():
    module = _bench()
    assert "vector_add_codegen.py" in module.DEFAULT_SCRIPTS.split(",")
    try:
        import jinja2  # noqa: F401

        jinja = ["vector_add_jinja.py", "vector_add_jinja2.py"]
    except ImportError:
        jinja = []
    assert module.runnable_scripts("generators") == ["vector_add_codegen.py", *jinja]
    assert module.runnable_scripts("vector_add.py,generators,vector_add.py")[0] == "vector_add.py"
