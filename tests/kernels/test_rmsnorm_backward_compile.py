"""rmsnorm_backward variants compile for sm_90 and sm_80 with sane ptxas resources: a
covering sample in CI, every distinct variant with KATO_COMPILE_FULL=1
(tests/kernels/rowwise_compile_common.py says how the sample is drawn and what is checked)."""

from __future__ import annotations

import pytest
import rowwise_compile_common as common
from kato.kernels import get_operator
from kato.tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")


class TestRmsnormBackwardCompile(common.BackwardCompileChecks):
    """Both kernels: stage 1 and the reduce of dweight's partial columns."""

    SPEC = get_operator("rmsnorm_backward")
    MAX_SAMPLE = 80
    REDUCE_KERNEL = "rmsnorm_bwd_reduce"
