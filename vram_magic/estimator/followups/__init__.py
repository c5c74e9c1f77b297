"""What an estimate answers next, from the same traces: the what-if table (``whatif.py``) and the largest batch or
longest sequence that fits (``search.py``)."""
