"""Kato's Python client: tuned kernel configs for training code, cached in process and on disk.

::

    from kato_client import KatoClient

    kato = KatoClient("http://kato:8000")          # GPU model detected on first use
    cfg = kato.config("softmax", (rows, cols), "float16")   # {"BLOCK_SIZE": 256, ...}

See :class:`KatoClient` for the caches, offline mode and the policies for untuned shapes.
:class:`KatoError` is Kato's root error (:mod:`kato.errors`); the client raises
:class:`ServiceError` (a refused request) and :class:`KatoUnavailable` (no service).
"""

from kato.errors import KatoError, ServiceError
from kato_client.client import KatoClient, KatoOfflineWarning, KatoUnavailable, Lookup
from kato_client.device import GpuNotDetected, detect_gpu
from kato_client.policy import POLICIES, bucket_shape

__all__ = [
    "POLICIES",
    "GpuNotDetected",
    "KatoClient",
    "KatoError",
    "KatoOfflineWarning",
    "KatoUnavailable",
    "Lookup",
    "ServiceError",
    "bucket_shape",
    "detect_gpu",
]
