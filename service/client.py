"""The Python client lives in the ``kato_client`` package; this module re-exports it."""

from kato_client import *  # noqa: F403
from kato_client import __all__  # noqa: F401
