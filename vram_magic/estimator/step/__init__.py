"""A training or inference step as a workload.

* ``trace.py`` — the fake run: two steps of the user's model; ``first_step.py`` — its first step remade from an
  earlier run's state;
* ``loss.py`` and ``optimizers.py`` — the loss and the optimizer the step uses, as the target device picks them;
* ``workload.py`` — traced once per configuration that changes the trace, replayed for the rest;
  ``candidates.py`` — the changes worth trying; ``ranks.py`` — a tensor- or pipeline-parallel step per rank.
"""
