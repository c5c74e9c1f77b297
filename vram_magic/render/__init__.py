"""Renderers: pure functions of a result (text, HTML, matplotlib). No measuring here.

The six category colours are chosen to stay apart under the common colour-vision deficiencies: the smallest
CIE76 distance between any two of them is about 29 for normal vision and for simulated protanopia,
deuteranopia and tritanopia (Machado et al. 2009), where the earlier palette fell to 7; the KV cache's dark
green is at least 31 from each of the other five under all four. Each also stands off
both a white and a near-black background, so the bars read in light and dark themes
(``tests/measuring/test_render.py`` checks both properties).
"""

COLORS = {
    "parameters": "#785EF0",  # violet-blue
    "gradients": "#E69F00",  # orange
    "optimizer_state": "#882255",  # wine
    "activations": "#56B4E9",  # sky blue
    "kv_cache": "#117722",  # dark green
    "other": "#AAAAAA",  # grey: the rest
}

# One letter per category where only text can draw a bar (terminals, sanitized HTML).
LETTERS = {"parameters": "P", "gradients": "G", "optimizer_state": "O", "activations": "A", "kv_cache": "K",
           "other": "."}
