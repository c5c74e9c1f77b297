"""``generate()`` as a workload.

* ``trace.py`` — the fake ``generate()`` run; ``loop.py`` — transformers' decoding loops, modelled; ``manual.py`` — a
  hand-written decoder's loop; ``recorder.py`` — what the loop tells the estimate as it runs;
* ``cache.py`` and ``variants.py`` — caches described by what they cost, and those modelled;
* ``cuda.py`` — what a GPU does differently during ``generate()``;
* ``facts.py`` — what an estimate of generation knows beyond its peak;
* ``workload.py`` — one fake run per configuration that changes it, replayed for the rest; ``candidates.py`` — the
  changes worth trying.
"""
