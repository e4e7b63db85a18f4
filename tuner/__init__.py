"""Kato's tuner: GPU catalog, occupancy, search space, backends, search loop and worker.

Importing this package never imports a GPU library; only ``tuner.backends.pycuda`` does, lazily.
"""
