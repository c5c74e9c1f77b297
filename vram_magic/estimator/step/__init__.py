"""A training or inference step as a workload.

* ``trace.py`` — the fake run: two steps of the user's model; ``first_step.py`` — its first step remade from an
  earlier run's state;
* ``loss.py`` and ``optimizers.py`` — the loss and the optimizer the step uses, as the target device picks them;
  ``low_bit_optimizers.py`` — bitsandbytes' and torchao's 8-bit, 4-bit, fp8 and paged optimizers, their state made
  from the parameters' shapes; ``muon.py`` — Muon for the matrices with AdamW for the rest;
* ``workload.py`` — traced once per configuration that changes the trace, replayed for the rest;
  ``candidates.py`` — the changes worth trying; ``ranks.py`` — a tensor- or pipeline-parallel step per rank;
* ``recipes/`` — the user's own step (``step=fn``), the step's convention in words, and the recipes' levers: an
  optimizer in backward, activations on the host, the loss in chunks, op-level checkpointing.
"""
