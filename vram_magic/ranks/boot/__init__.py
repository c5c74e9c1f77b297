"""Not imported: this folder goes on the ``PYTHONPATH`` of the processes a ``%%vram --ranks`` cell starts, for
its ``sitecustomize`` (a package so that it ships with vram_magic)."""
