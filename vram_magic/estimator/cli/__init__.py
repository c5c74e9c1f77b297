"""The command line of the estimator: ``python -m vram_magic estimate`` (``estimate_cmd.py``) and ``python -m
vram_magic plan`` (``plan_cmd.py``), with the options they share with ``%vram_estimate`` and ``%vram_plan``
(``arguments.py``)."""
