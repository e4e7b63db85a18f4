"""A user operator's default config for an untuned shape (what any reader's lookup is served)
costs a bounded number of restriction checks, whatever the size of its space."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from kato.kernels.spec import InvalidInput
from kato.kernels.user import spec_from_folder

DATA = Path(__file__).parent / "data" / "vector_add"


def _big_space(tmp_path: Path, default: str = "") -> Path:
    """vector_add with four more tunables of 14 values each (921,984 combinations), all but
    the last few refused by a restriction (at n >= 2, every one)."""
    folder = tmp_path / "bigspace"
    shutil.copytree(DATA, folder)
    spec = (folder / "kato.toml").read_text()
    spec = spec.replace('name = "vector_add_test"', 'name = "bigspace"')
    spec = spec.replace(
        'restrictions = ["block_size_x * tile_size_x <= 4096"]',
        'restrictions = ["block_size_x * tile_size_x <= 4096", "p1 + p2 + p3 + p4 > 4050 + n"]',
    )
    values = ", ".join(str(v) for v in range(1000, 1014))
    params = "".join(f"p{i} = [{values}]\n" for i in range(1, 5))
    spec = spec.replace("[tune_params]\n", f"{default}[tune_params]\n{params}")
    (folder / "kato.toml").write_text(spec)
    return folder


def test_a_mostly_invalid_space_is_refused_fast_with_what_to_do(tmp_path):
    spec = spec_from_folder(_big_space(tmp_path))
    assert spec.space_size() == 14**4 * 6 * 4
    started = time.perf_counter()
    with pytest.raises(InvalidInput, match="declare a valid `default`"):
        spec.default_config((100,), "float32")
    # Checking the whole space one config at a time took 17 s on a 2-core machine; screened
    # (2**18 combinations in order, 2**18 at random), about 0.3 s.
    assert time.perf_counter() - started < 5
    started = time.perf_counter()
    with pytest.raises(InvalidInput, match="declare a valid `default`"):
        spec.default_config((100,), "float32")  # answered from memory, no second scan
    assert time.perf_counter() - started < 0.05


def test_a_declared_default_is_served_and_the_answer_is_kept_per_shape(tmp_path):
    default = (
        "[default]\np1 = 1013\np2 = 1013\np3 = 1013\np4 = 1013\n"
        "block_size_x = 32\ntile_size_x = 1\n\n"
    )
    spec = spec_from_folder(_big_space(tmp_path, default))
    # At n = 1 only p1 = ... = p4 = 1013 pass: past the scan's bound, found as declared.
    config = spec.default_config((1,), "float32")
    assert config["p1"] == 1013 and spec.check(config, (1,), "float32") is None
    config["p1"] = 0  # the caller's copy: the kept answer is not changed
    assert spec.default_config((1,), "float32")["p1"] == 1013
    with pytest.raises(InvalidInput):  # the default is not valid at n = 100: nothing is
        spec.default_config((100,), "float32")


def _huge_space(tmp_path: Path, restriction: str, values: str = "") -> Path:
    """vector_add with six more tunables of 100 values each (2.4e13 combinations) and
    ``restriction`` on them."""
    folder = tmp_path / "huge"
    shutil.copytree(DATA, folder)
    spec = (folder / "kato.toml").read_text()
    spec = spec.replace('name = "vector_add_test"', 'name = "huge"')
    spec = spec.replace(
        'restrictions = ["block_size_x * tile_size_x <= 4096"]',
        f'restrictions = ["block_size_x * tile_size_x <= 4096", "{restriction}"]',
    )
    values = values or ", ".join(str(v) for v in range(100))
    params = "".join(f"q{i} = [{values}]\n" for i in range(1, 7))
    spec = spec.replace("[tune_params]\n", f"[tune_params]\n{params}")
    (folder / "kato.toml").write_text(spec)
    return folder


def test_a_huge_sparse_space_serves_a_valid_default_past_the_first_combinations(tmp_path):
    # q1 is the slowest-moving tunable: no combination among the first 10^11 holds q1 >= 50.
    spec = spec_from_folder(_huge_space(tmp_path, "q1 >= 50 and q2 % 7 == 3"))
    started = time.perf_counter()
    config = spec.default_config((1000,), "float32")
    assert time.perf_counter() - started < 5  # about 0.5 s of screening on a 2-core machine
    assert config["q1"] >= 50 and spec.check(config, (1000,), "float32") is None
    # The same answer from a fresh spec (the draw's seed is fixed: every host serves it).
    assert spec_from_folder(_huge_space(tmp_path / "again", "q1 >= 50 and q2 % 7 == 3")
                            ).default_config((1000,), "float32") == config  # fmt: skip


def test_a_space_refusing_everything_says_so(tmp_path):
    spec = spec_from_folder(_huge_space(tmp_path, "q1 > 1000"))
    with pytest.raises(InvalidInput, match="nor of .* drawn at random .* declare a valid"):
        spec.default_config((1000,), "float32")
    small = spec_from_folder(_huge_space(tmp_path / "small", "q1 > 5", values="1, 2, 3"))
    with pytest.raises(InvalidInput, match="refuse all 17496 combinations"):
        small.default_config((1000,), "float32")


def test_values_the_screen_cannot_take_are_checked_one_at_a_time_within_the_bound(tmp_path):
    # A tunable mixing ints and strings is checked config by config, at most MAX_DEFAULT_SCAN.
    spec = spec_from_folder(_huge_space(tmp_path, "q1 == 'x'", values="'x', 1, 2, 3, 4"))
    assert spec.default_config((1000,), "float32")["q1"] == "x"
    refused = spec_from_folder(
        _huge_space(tmp_path / "never", "q6 == 'y'", values="'x', 1, 2, 3, 4")
    )
    with pytest.raises(InvalidInput, match="none of the 10000 combinations .* checked"):
        refused.default_config((1000,), "float32")
