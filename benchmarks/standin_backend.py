"""A CPU stand-in for the ``pycuda`` backend kind's measuring child (``benchmarks/spare_child.py``):
it imports what a ``pycuda`` child imports apart from PyCUDA and the GPU (numpy, ml_dtypes, the
operator registry, ``kato.tuner.backends.pycuda``, which imports PyCUDA only when a backend is
built) and answers from a recorded space. Used as ``BackendSpec(kind=
"benchmarks.standin_backend:make", replay_file=...)``; the child finds it on the inherited
``sys.path`` (the repository's root).
"""

from __future__ import annotations

import kato.kernels  # noqa: F401  (the operator registry, as build_backend's get_operator)
import kato.tuner.backends.pycuda  # noqa: F401  (the pycuda kind's module, without PyCUDA)
import numpy  # noqa: F401
from kato.tuner.backends.base import Backend
from kato.tuner.backends.isolated import BackendSpec
from kato.tuner.backends.replay import ReplayBackend


def make(spec: BackendSpec) -> Backend:
    assert spec.replay_file is not None
    return ReplayBackend(spec.replay_file)
