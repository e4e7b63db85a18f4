"""kato.tuner.cubin: which compiled modules keep state in ``__device__`` variables (kato_torch
loads those once per stream), read from the cubins nvcc makes."""

from __future__ import annotations

import pytest
from kato.kernels import get_operator
from kato.tuner.cubin import has_device_globals, section_names
from kato.tuner.nvcc import compile_kernel, nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SOURCE = """
{decl}
extern "C" __global__ void k(float* y) {{ y[threadIdx.x] = {use}; }}
"""


def cubin(decl: str, use: str) -> bytes:
    return compile_kernel(SOURCE.format(decl=decl, use=use), "k", arch="sm_90").cubin


@pytest.mark.parametrize(
    ("decl", "use", "expected"),
    [
        ("", "1.0f", False),
        ("__constant__ float c[4];", "c[threadIdx.x % 4]", False),  # read-only on the device
        ("__device__ float g[4];", "g[threadIdx.x % 4]++", True),  # uninitialised
        ("__device__ float g[4] = {1, 2, 3, 4};", "g[threadIdx.x % 4]++", True),  # initialised
    ],
)
def test_device_variables_are_found_and_constants_are_not(decl, use, expected):
    assert has_device_globals(cubin(decl, use)) is expected


def test_softmax_split_rows_keep_partials_in_the_module_and_other_strategies_do_not():
    spec = get_operator("softmax")
    for shape, strategy, expected in (((8, 4194304), 2, True), ((4096, 4096), 1, False)):
        config = spec.default_config(shape, "float32")
        assert config["STRATEGY"] == strategy
        compiled = compile_kernel(
            spec.render(config, shape, "float32"), spec.main_kernel(config), arch="sm_90"
        )
        assert has_device_globals(compiled.cubin) is expected


def test_anything_but_a_64_bit_elf_image_is_refused():
    with pytest.raises(ValueError, match="not an ELF"):
        section_names(b"\x00" * 128)
    image = bytearray(cubin("", "1.0f"))
    assert b".text.k" in section_names(bytes(image))
    image[4] = 1  # ELFCLASS32
    with pytest.raises(ValueError, match="64-bit"):
        section_names(bytes(image))
