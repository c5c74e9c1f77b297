"""The planner: the combinations of strategies that fit, ranked by their estimated step time.

* ``planner.py`` — a training step's plan; ``generate_planner.py`` — a ``generate()`` call's; ``step_plan.py`` —
  what a plan of the user's own step (``step=fn``) searches and refuses;
* ``choices.py`` — one combination of strategies and what it means for the user;
* ``result.py`` — :class:`~vram_magic.estimator.planning.result.Plan` and its rows; ``render.py`` and ``figure.py`` —
  its text, HTML and picture.
"""
