"""Who holds each live storage: parameters, gradients, optimizer state, activations or other.

* ``registry.py`` — a weak registry of live storages, keyed by the storage's identity (weakrefs only);
* ``frame_namespace.py`` — where a block's variables are looked for;
* ``walk.py`` — what a scan finds in the namespace, a few levels deep; ``containers.py`` — what it does with each
  kind of object; ``summed.py`` and ``dict_version.py`` — big containers counted by their sums, and remembered;
* ``autograd_graph.py`` — what an autograd graph saved for backward;
* ``attribution.py`` — the scan turned into categories; ``categories.py`` — what each block of a history counts as,
  for both backends.
"""
