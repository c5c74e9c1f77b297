"""The recipes people train with now, each a small named lever a step switches on (after torchtune's components), and
the user's own step when no name fits:

* ``user_step.py`` — ``step=fn``: ``fn(model, batch, optimizer)`` traced exactly as written, its stages read as
  ``%%vram`` reads them;
* ``convention.py`` — the step an estimate assumed, in words (the built-in step keeping its output through backward or
  not, the levers it ran);
* ``in_backward.py`` — ``optimizer_in_backward``: one optimizer per parameter, stepping inside backward;
* ``offload_activations.py`` — ``offload_activations``: what autograd saves kept on the host (``save_on_cpu``);
* ``chunked_loss.py`` — ``loss_chunks``: a causal LM's head and cross-entropy chunk by chunk (torchtune's);
* ``op_checkpointing.py`` — ``checkpointing="ops"``: op-level selective checkpointing of each block (torchtitan's).
"""
