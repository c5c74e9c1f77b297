"""The allocator-level backend, off the dispatch path: PyTorch's profiler records every allocation and free.

* ``recorder.py`` — the profiler's memory events of a block, replayed;
* ``kernel_scratch.py`` — what CPU kernels allocate and free inside one op, which a dispatch mode cannot see;
* ``stderr_filter.py`` — one line of c10's kept out of the user's cell while the profiler records.
"""
