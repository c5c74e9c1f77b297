"""Renderers: pure functions of a result (text, HTML, ipywidgets, matplotlib). No measuring here."""

COLORS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_state": "#55A868",
    "activations": "#C44E52",
    "other": "#8C8C8C",
}
