"""Kato's error hierarchy: one root, :class:`KatoError`, that every error Kato raises on
purpose derives from, so ``except kato.KatoError`` catches them all.

This module is a leaf: it imports nothing of the project, so every layer (kernels, tuner, db,
service, the client) may import it. Besides the root, it defines the errors more than one layer
raises (:class:`InvalidInput`, :class:`ServiceError`); the others live beside the code that raises
them, keeping their names and their builtin bases (``InvalidInput`` is still a ``ValueError``,
``UnknownId`` a ``LookupError``): code that caught those keeps working. The tree, by kind::

    KatoError
    ├── InvalidInput (ValueError)          a request that cannot be served (HTTP 422)
    │   ├── UnknownGpu                     kato.shared.gpus
    │   └── ExpressionError                kernels.user.expr
    ├── InvalidImport (ValueError)         db.importer: a file that cannot be imported
    ├── FormatError (ValueError)           db.formats: not a valid T4 / Kernel Tuner file
    ├── ExportError (ValueError)           db.export
    ├── UnknownId, AmbiguousId (LookupError)   db.ids (and db.tokens' token id aliases)
    ├── QuotaExceeded                      db.tokens: a token's queue is full (HTTP 429)
    ├── CompileError                       tuner.nvcc: a config's source does not compile
    ├── NvccNotFoundError (RuntimeError)   tuner.nvcc: the machine has no usable nvcc
    ├── UnmeasurableTask (RuntimeError)    tuner.trial_cost
    ├── ReferenceKernelError (RuntimeError)  tuner.backends.pycuda
    ├── ChildStartError (RuntimeError)     tuner.backends.isolated
    ├── TrialInterrupted                   tuner.backends.isolated: a stop, not a fault
    ├── GpuNotDetected (RuntimeError)      kato_client.device
    ├── CudaDriverError (RuntimeError)     tuner.cuda_driver
    └── ServiceError (RuntimeError)        a Kato service refused a request or cannot be used
        └── KatoUnavailable                kato_client: the service cannot be reached

``kato_client.KatoError`` is this root (the client's own errors are :class:`ServiceError` and
``KatoUnavailable``). Errors that are not Kato's (a database driver's, an HTTP library's, a
bug) are not wrapped: they pass through as they are.
"""

from __future__ import annotations


class KatoError(Exception):
    """The root of every error Kato raises on purpose; its message says what to fix."""

    #: The HTTP status of a service's answer behind the error (:class:`ServiceError`); None
    #: for every other error, so a handler may read it off any Kato error.
    status: int | None = None


class ServiceError(KatoError, RuntimeError):
    """A Kato service refused a request (its ``detail`` in the message) or could not be used.

    ``status`` is the HTTP status of the answer, where there was one.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class InvalidInput(KatoError, ValueError):
    """A request that cannot be served: unknown dtype, shape of the wrong rank, non-positive sizes.

    The message says what to fix; the service turns it into an HTTP 422.
    """
