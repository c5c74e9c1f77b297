"""The host beside the device: what this machine's process table says about a process (``procs.py``: alive, resident
memory, parents, children, pid namespaces) and the host memory of a measured block (``sampler.py``: the resident
memory of the process and its children, before, after and at the block's peak, beside what the machine has left)."""
