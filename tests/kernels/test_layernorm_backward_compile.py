"""layernorm_backward variants compile for sm_90 and sm_80 with sane ptxas resources: a
covering sample in CI, every distinct variant with KATO_COMPILE_FULL=1
(tests/kernels/rowwise_compile_common.py says how the sample is drawn and what is checked)."""

from __future__ import annotations

import kato.kernels.layernorm_backward as lb
import pytest
import rowwise_compile_common as common
from kato.kernels import get_operator
from kato.tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")


class TestLayernormBackwardCompile(common.BackwardCompileChecks):
    """Both kernels: stage 1 (its row reduction holds float2 pairs) and the reduce of dweight
    and dbias partial columns."""

    SPEC = get_operator("layernorm_backward")
    MAX_SAMPLE = 80
    REDUCE_KERNEL = "layernorm_bwd_reduce"
    stage1_shared_bytes = staticmethod(lb.reduction_shared_bytes)
