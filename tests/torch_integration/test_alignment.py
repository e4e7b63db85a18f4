"""Views that start a few elements into their storage (issue 31): kato_torch reads the data
pointers' common alignment and binds a variant whose vectors fit it, instead of launching the
served config's 16-byte vectors on a pointer they would fault on."""

from __future__ import annotations

import torch
from kato.kernels import get_operator

from kato_torch._kernels import fit_alignment, pointer_alignment


def test_pointer_alignment_is_the_common_power_of_two() -> None:
    storage = torch.zeros(64, dtype=torch.float16)
    assert storage.data_ptr() % 16 == 0
    assert pointer_alignment([storage, 3, 0.5, None]) == 16
    assert pointer_alignment([storage[1:]]) == 2
    assert pointer_alignment([storage[2:]]) == 4
    assert pointer_alignment([storage[4:], storage]) == 8
    assert pointer_alignment([storage[8:], storage[6:]]) == 4
    assert pointer_alignment([torch.zeros(4, dtype=torch.float32)[3:]]) == 4


def test_fit_alignment_narrows_vec_only_where_the_pointers_need_it() -> None:
    spec = get_operator("softmax")
    shape, dtype = (37, 1001), "float16"
    config = {"BLOCK_SIZE": 256, "VEC": 8, "STRATEGY": 1, "CACHE": 0, "MIN_BLOCKS": 0}
    assert fit_alignment(spec, config, shape, dtype, 16) == config
    assert fit_alignment(spec, config, shape, dtype, 8)["VEC"] == 4
    assert fit_alignment(spec, config, shape, dtype, 4)["VEC"] == 2
    narrowed = fit_alignment(spec, config, shape, dtype, 2)
    assert narrowed == {**config, "VEC": 1}
    assert spec.check(narrowed, shape, dtype) is None
    # A narrower vector that no longer fits the register cache is not offered.
    cached = {"BLOCK_SIZE": 32, "VEC": 8, "STRATEGY": 0, "CACHE": 2, "MIN_BLOCKS": 0}
    assert spec.check(cached, (4, 4096), dtype) is None
    assert fit_alignment(spec, cached, (4, 4096), dtype, 2) is None
