"""Kato's operator library.

Each operator lives in its own sub-package (``kernels/softmax/``): a CUDA template (``.cu``) whose
tunable parameters arrive as preprocessor macros, and an :class:`~kernels.spec.OperatorSpec` that
describes the parameter space, constraints, launch geometry, inputs, float64 reference, tolerance
and bytes moved. Nothing here imports a GPU library: specs are plain data and functions.
"""

from kato.kernels.registry import get_operator, list_operators, register
from kato.kernels.spec import (
    DTYPES,
    Config,
    InvalidInput,
    Launch,
    OperatorSpec,
    Problem,
    Step,
)

from kato.shared.kt_cache import config_key

__all__ = [
    "DTYPES",
    "Config",
    "InvalidInput",
    "Launch",
    "OperatorSpec",
    "Problem",
    "Step",
    "config_key",
    "get_operator",
    "list_operators",
    "register",
]
