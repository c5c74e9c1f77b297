"""An estimate shown: what every report shows (``common.py``), a step's (``step.py``), a ``generate()`` call's
(``generation.py``), a tensor- or pipeline-parallel step's (``ranks.py``) and the what-if table (``table.py``)."""
