"""The live-storage tracker: a ``TorchDispatchMode`` that counts every storage an op returns and every free.

* ``mode.py`` — :class:`~vram_magic.engine.tracker.mode.Tracker`, the dispatch mode: what it does with each op;
* ``counts.py`` — the storages alive, the peak and the history of allocations and frees;
* ``step_hooks.py`` — module forwards and optimizer steps: each allocation's phase and module, the roles a step
  reveals;
* ``frames.py`` and ``sites.py`` — the user's line of each allocation, taken cheaply;
* ``op_kinds.py`` — what to do with each op, decided once per process; ``scratch_ops.py`` — the ops whose CPU
  kernels allocate inside themselves;
* ``storage_resize.py`` — storages resized in place, which dispatch never sees;
* ``oom_frames.py`` — the user's frames at an out-of-memory error: who held what, and their locals released;
* ``observer.py`` — what a tool built on the tracker hears (the estimator's step tracer).
"""
