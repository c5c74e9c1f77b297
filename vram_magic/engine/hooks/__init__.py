"""What other libraries do, as the tracker and the namespace scan must see it.

* ``generation.py`` and ``kv_cache.py`` — ``generate()``'s phases and the KV caches (transformers' and others');
* ``collectives.py`` — the buffers of FSDP, DDP and tensor parallelism;
* ``pipeline.py`` — ``torch.distributed.pipelining``'s stages and their buffers;
* ``quantized.py`` — quantized weights (bitsandbytes, torchao, torch.ao), every byte a parameter;
* ``compiled.py`` — whether a block runs ``torch.compile``d code, and running it eagerly under the tracker.
"""
