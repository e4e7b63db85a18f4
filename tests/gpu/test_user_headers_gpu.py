"""A folder operator whose template and reference kernel include headers beside them
(tests/user_ops/data/vector_add_header): every variant, with its headers inlined, matches the
reference kernel's outputs on the GPU, at a size no block or tile divides."""

from __future__ import annotations

import itertools

import numpy as np
from kato.kernels.registry import register
from kato.kernels.user import spec_from_folder
from user_ops.test_headers import FOLDER

N = 1_000_003


def test_every_variant_with_its_headers_matches_the_reference_kernel():
    from kato.tuner.backends.pycuda import PyCudaBackend

    op = register(spec_from_folder(FOLDER))
    backend = PyCudaBackend(op, (N,), "float32", repeats=3, warmup=1, seed=0)
    try:
        a, b = backend.problem.args[1], backend.problem.args[2]
        np.testing.assert_array_equal(backend.problem.references[0], (a + b).astype(np.float64))
        measured = 0
        for values in itertools.product(*op.params.values()):
            config = dict(zip(op.params, values, strict=True))
            if op.check(config, (N,), "float32") is None:
                result = backend.evaluate(config)
                assert result.ok, (config, result.error)
                measured += 1
        assert measured == 23
    finally:
        backend.close()
