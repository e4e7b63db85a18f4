"""Data every layer shares, in one leaf: the GPU catalog (:mod:`kato.shared.gpus`), Kernel Tuner's
and T4's file formats (:mod:`kato.shared.kt_cache`), job and trial statuses
(:mod:`kato.shared.status`), Kato's on-disk places (:mod:`kato.shared.paths`) and SQLite's WAL
switch (:mod:`kato.shared.sqlite`).

Like :mod:`kato.errors` and :mod:`kato.env`, these modules import nothing of the project but each
other, so kernels, db, tuner, service, the client and kato_torch may all import them
(``tests/test_layers.py`` holds that).
"""
