"""Kato's Kernel Tuner-compatible front door: ``import kato`` and call
``kato.tune_kernel(...)`` where you called ``kernel_tuner.tune_kernel(...)``; the tuned config
is then a lookup (``kato.lookup``). See docs/user_kernels.md."""

from kato.tune import lookup, tune_kernel

__all__ = ["lookup", "tune_kernel"]
