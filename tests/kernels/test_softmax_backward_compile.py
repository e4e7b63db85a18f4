"""softmax_backward variants compile for sm_90 and sm_80 with sane ptxas resources: a
covering sample in CI, every distinct variant with KATO_COMPILE_FULL=1
(tests/kernels/rowwise_compile_common.py says how the sample is drawn and what is checked)."""

from __future__ import annotations

import pytest
import rowwise_compile_common as common
from kato.kernels import get_operator
from kato.tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")


class TestSoftmaxBackwardCompile(common.NormCompileChecks):
    """CACHE=2 keeps both rows (y and dy) in registers; there is no weight."""

    SPEC = get_operator("softmax_backward")
    MAX_SAMPLE = 70
    WEIGHT_IN_REGISTERS = False
