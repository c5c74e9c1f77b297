"""The machinery both features run on: measuring a block of code (``vram_magic/measuring/``) and estimating one
(``vram_magic/estimator/``). Nothing here imports a feature.

* ``tracker/`` — the dispatch mode that sees every tensor an op returns, and the parts it is made of;
* ``scan/`` — who holds each live storage: the weak registry of storages, the namespace walk, attribution to
  categories;
* ``hooks/`` — what other libraries do that the tracker and the scan must know: ``generate()`` and KV caches,
  collectives, pipelining, quantized weights, compiled code;
* ``profiler/`` — the allocator-level backend: PyTorch's profiler's memory events, kernel scratch on the CPU;
* ``cuda/`` — what only a CUDA device answers: the device around a block, the caching allocator's history, rules and
  settings, out-of-memory messages;
* ``phases.py`` — the phases of a step, and what memory made in each counts as; ``tensors.py`` — the storages behind
  a tensor of any kind; ``after_import.py`` — something run once a module is first imported; ``torch_private.py`` —
  every private name of PyTorch's that the engine uses.
"""
