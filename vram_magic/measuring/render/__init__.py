"""A measured block shown: text (``text.py``), HTML (``html.py``), the timeline (``timeline.py``) and the display
bundles the notebook gets (``widget.py``); pure functions of the results."""
