"""What lives across cells.

* ``state.py`` — :class:`~vram_magic.session.state.Session`: the history, the previous report, settings, auto mode;
* ``tables.py`` — the measured cells as tables (pandas), and their export;
* ``live.py`` — the live view of a running cell, from a background thread;
* ``monitor.py`` and ``monitor_html.py`` — ``%vram watch``: the standing monitor and its readings.
"""
