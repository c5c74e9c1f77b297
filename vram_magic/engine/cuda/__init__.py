"""What only a CUDA device can answer: the device and its counters around a cell, ``--budget`` (``cell.py``), the
caching allocator's history replayed (``history.py``), what a device holds (``usage.py``), what an out-of-memory
error says (``oom.py``)."""
