"""Kernels in the style of Kernel Tuner's CUDA examples (vector add, a shared-memory matmul, a 2-D
convolution, a sum reduction), written for Kato's benchmark ``benchmarks/kt_examples.py``: each
is a ``tune_kernel`` call's arguments, the same for Kernel Tuner and ``kato.tune_kernel``."""
