"""Measuring a block of code: ``vram_magic.measure()`` and ``%%vram``.

* ``measurement.py`` — :func:`~vram_magic.measuring.measurement.measure`, the context manager; ``backend.py`` — which
  backend records (the tracker, or the profiler's allocator events);
* ``cell_trace.py`` — the block's trace from what its backend recorded; ``record.py`` — from the finished block to
  its report;
* ``report.py`` — :class:`~vram_magic.measuring.report.CellReport`, frozen, in bytes; ``advice.py`` — what to do about
  it;
* ``snapshot.py`` — the history in PyTorch's memory-snapshot format; ``live_status.py`` — a block while it runs;
* ``render/`` — the report, the live view and ``%vram`` as text, HTML and a timeline;
* ``demo.py`` — ``python -m vram_magic demo``.
"""
