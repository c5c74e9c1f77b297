"""How long a step takes: a traced step's ops timed on a device.

* ``step_time.py`` — one configuration's step time; ``cost.py`` — the ops and what a layout adds to them;
* ``rates.py`` — what one device achieves (FLOP rates by dtype and size, bandwidths);
* ``cpu_profile.py`` and ``cpu_gemm.py`` — this CPU, measured once per process.
"""
