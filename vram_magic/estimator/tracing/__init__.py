"""Running a model on fake tensors under the engine's tracker, and what the run leaves.

* ``tracer.py`` — the tracker taught about a fake step (stage, module, FLOPs of every storage); ``oplog.py`` — what
  each op did, for the time model; ``scratch.py`` — kernel scratch that dispatch cannot see;
* ``traced.py`` — the plain numbers a fake run leaves (:class:`~vram_magic.estimator.tracing.traced.FakeRun`);
  ``kept.py`` — the traces a workload keeps;
* ``errors.py`` — what went wrong in a fake run, said once; ``compiled/`` — compiled models, as compiled training
  runs them.
"""
