"""Kato's REST service: the FastAPI app factory (:func:`service.app.create_app`), its routes,
request/response schemas and settings (``KATO_*`` environment variables).

Importing this package is cheap; import ``service.app`` for the application.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kato")
except PackageNotFoundError:  # running from a source checkout
    __version__ = "0.1.0"
