"""Measurement backends behind one interface (:class:`tuner.backends.base.Backend`).

``pycuda`` compiles and times kernels on a real GPU; ``replay`` answers from a recorded Kernel
Tuner cache file. Import a backend's module only when you need it: ``tuner.backends.pycuda``
imports pycuda.
"""

from kato.tuner.backends.base import Backend, DeviceInfo, TrialResult, TrialStatus

__all__ = ["Backend", "DeviceInfo", "TrialResult", "TrialStatus"]
