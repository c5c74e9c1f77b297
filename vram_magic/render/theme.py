"""Inline styles that follow the notebook's theme and survive HTML sanitizers.

What a saved output holds is read by several renderers with different rules:

- JupyterLab and Notebook 7 (trusted output), nbconvert, VS Code: any inline style; CSS variables resolve.
- JupyterLab and Notebook 7 with an *untrusted* notebook (one you did not run yourself): a sanitizer keeps
  ``style`` but drops every declaration whose value is not a plain length or colour (``var()``,
  ``color-mix()``, ``currentColor``, ``flex``, ``transform`` go), and drops ``<svg>`` and ``<style>``.
- ``nbconvert --sanitize-html`` (a stand-in for GitHub-like viewers): only ``div span table tr td pre code b
  strong em i ul ol li a`` with ``class``/``id``; every ``style`` attribute goes, other tags are escaped.

So text colours are either inherited (always the theme's text colour) or mixes with ``currentColor`` that a
sanitizer drops back to the inherited colour; bar colours are plain hex; empty tracks and marker lines use
semi-transparent greys and ``currentColor`` borders, readable on light and dark backgrounds alike. Layout uses
CSS tables inside a ``<pre>`` (see :func:`.bars.grid_html`) and absolute positions, never flexbox properties
the first sanitizer drops. Elements that only the
third renderer should show carry the ``hidden`` attribute, which it strips.
"""

from __future__ import annotations

# Text colours: mixed with the inherited text colour, so they keep contrast in light and dark themes
# (≥ 4.5:1 on JupyterLab's light and dark backgrounds); a sanitizer that drops color-mix() leaves the
# inherited colour, which reads too.
MUTED = "color:color-mix(in srgb,currentColor 72%,transparent)"
GROW = "color:color-mix(in srgb,#d62728 70%,currentColor)"
SHRINK = "color:color-mix(in srgb,#2ca02c 70%,currentColor)"
GOOD = SHRINK
BAD = GROW

# The empty part of a bar: a faint grey on either background, never a bright block in the dark.
TRACK = "background:rgba(128,128,128,0.14);border:1px solid rgba(128,128,128,0.55)"
# Gridlines behind the bars.
GRID = "background:rgba(128,128,128,0.35)"
# The memory a failed request asked for: outlined in the text colour over a translucent red.
REQUEST = "background:rgba(214,39,40,0.35);border:2px dashed"
# A reserve the allocator and the CUDA context add on top of the tensors (estimates).
RESERVE = "background:rgba(128,128,128,0.35);border:1px dashed"

ROOT = ("line-height:1.35;word-break:normal;overflow-wrap:normal;max-width:64em;overflow-x:auto;"
        "padding-bottom:2px;text-align:left")
NUM = "font-variant-numeric:tabular-nums;white-space:nowrap;text-align:right"
SMALL = "font-size:92%"
