"""Installs the repository's db/, kernels/, service/ and tuner/ folders as ``kato.db``,
``kato.kernels``, ``kato.service`` and ``kato.tuner``, so that a user's site-packages gets one
``kato`` package (beside ``kato_client`` and ``kato_torch``) and no top-level ``db`` or ``service``.
Everything else about the distribution is in pyproject.toml."""

from setuptools import find_packages, setup

#: Folders of the repository installed under ``kato.``.
MAPPED = ("db", "kernels", "service", "tuner")

packages = find_packages(include=["kato", "kato.*", "kato_client", "kato_client.*"])
packages += find_packages(include=["kato_torch", "kato_torch.*"])
for name in MAPPED:
    packages += [f"kato.{package}" for package in find_packages(include=[name, f"{name}.*"])]

setup(packages=packages, package_dir={f"kato.{name}": name for name in MAPPED})
