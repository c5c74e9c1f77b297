"""The words every feature speaks, with no torch at import.

* ``units.py`` — byte sizes: what users type, and binary units (KiB, MiB, GiB) as nvidia-smi and PyTorch print them;
* ``breakdown.py`` — the memory categories and :class:`~vram_magic.core.breakdown.Breakdown`, bytes per category;
* ``events.py`` — the allocation history of a block (:class:`~vram_magic.core.events.Trace`), one event model for CPU
  and CUDA, and the peak over a stream of allocations;
* ``device_stats.py`` — what a device says of its own memory;
* ``rendered.py`` — how a result shows itself (``print()``, IPython's pretty printer, the notebook).
"""
