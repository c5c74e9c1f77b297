"""Measuring a block of code (``measure()``, ``%%vram``): the measurement itself (``measurement.py``), which
backend records it (``backend.py``), its trace from what the backend recorded (``trace.py``) and the report
(``report.py``)."""
