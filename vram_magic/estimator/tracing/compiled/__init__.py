"""Compiled models (``torch.compile``) on fake tensors: the graphs AOTAutograd makes run by the estimate's backend
(``backend.py``), what Inductor writes to memory (``fusion.py``) and its layout choices on the CPU (``layout.py``)."""
