"""What only a CUDA device can answer, and the caching allocator's rules as plain arithmetic.

* ``device.py`` — which device, its counters and history around a block, ``--budget``; looking never initialises CUDA;
* ``history.py`` — a block's part of the caching allocator's history, replayed in block sizes;
* ``usage.py`` — what a block did to a device, from plain data;
* ``caching_allocator.py`` and ``alloc_conf.py`` — the allocator's rules and its settings
  (``PYTORCH_CUDA_ALLOC_CONF``);
* ``oom_message.py`` — what an out-of-memory error says about the request that failed.
"""
