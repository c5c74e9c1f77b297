"""Every out-of-memory error explained, in cells nobody measured, in scripts and in ranks.

* ``report.py`` — :class:`~vram_magic.oom.report.OomReport`: what was alive by category and who held it, the failed
  request, and on CUDA what the allocator held (written to and read from JSON);
* ``build.py`` — a report from the error, the namespace, the failed frames and the allocator's state kept at the
  failure (``engine/cuda/oom_watch.py``), with the allocator settings that would have served the request
  (``engine/cuda/settings_replay.py``) and advice;
* ``render.py`` — its text and HTML, and one bar per rank;
* ``black_box.py`` — armed by ``%load_ext vram_magic`` at no per-op cost: the report under the traceback of any cell
  that runs out of memory, and ``vram_magic.last_oom()``;
* ``script.py`` — ``python -m vram_magic run script.py``: a script (or each ``torchrun`` rank) with the same black
  box, its reports and PyTorch memory snapshots written to a folder; ``readback.py`` — ``vram_magic.read_oom(DIR)``.
"""
