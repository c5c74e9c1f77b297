"""What the renderers produce, checked on real measurements and estimates (a real IPython shell, real PyTorch).

The browser stage (``ci/ui.sh``) checks the same outputs as drawn by JupyterLab, Notebook 7 and nbconvert; here
the properties that do not need a browser: the palette under colour-vision deficiencies, the scale, markers
and zoom, what nbconvert's sanitizer leaves, the what-if order, tracebacks, tables and the timeline's labels.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from IPython.utils.capture import capture_output

import vram_magic
from tests.support import run, run_ok
from vram_magic.core.breakdown import CATEGORIES
from vram_magic.measuring.render.html import report_html, report_scale
from vram_magic.measuring.render.text import report_text
from vram_magic.measuring.render.widget import report_bundle
from vram_magic.render import COLORS
from vram_magic.render.bars import ZOOM_FRACTION, scale_for

F32 = 4
MiB = 2**20

# --- colour ---------------------------------------------------------------------------------------------------
# Machado, Oliveira & Fernandes (2009), severity 1, on linear RGB.
CVD = {
    "protanopia": [[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216], [-0.003882, -0.048116, 1.051998]],
    "deuteranopia": [[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413], [-0.011820, 0.042940, 0.968881]],
    "tritanopia": [[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602], [0.004733, 0.691367, 0.303900]],
}


def _linear(hex_colour: str) -> list[float]:
    out = []
    for i in (1, 3, 5):
        c = int(hex_colour[i:i + 2], 16) / 255
        out.append(c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4)
    return out


def _lab(rgb: list[float]) -> tuple[float, float, float]:
    r, g, b = rgb
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def _luminance(rgb: list[float]) -> float:
    return 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]


@pytest.mark.parametrize("vision", ["normal", *CVD])
def test_the_six_categories_stay_apart_under_colour_vision_deficiencies(vision: str) -> None:
    assert set(COLORS) == set(CATEGORIES)  # the KV cache's colour among them
    colours = {c: _linear(h) for c, h in COLORS.items()}
    if vision != "normal":
        m = CVD[vision]
        colours = {c: [min(max(sum(m[i][j] * v[j] for j in range(3)), 0), 1) for i in range(3)]
                   for c, v in colours.items()}
    closest = min(math.dist(_lab(colours[a]), _lab(colours[b])) for a, b in itertools.combinations(colours, 2))
    # the earlier palette fell to ΔE 7.3 under protanopia (gradients vs optimizer state)
    assert closest >= 25, f"two categories are only ΔE {closest:.1f} apart under {vision}"
    kv = min(math.dist(_lab(colours["kv_cache"]), _lab(colours[c])) for c in colours if c != "kv_cache")
    assert kv >= 30, f"the KV cache is only ΔE {kv:.1f} from another category under {vision}"


def test_every_category_stands_off_light_and_dark_backgrounds() -> None:
    for category, hex_colour in COLORS.items():
        lum = _luminance(_linear(hex_colour))
        on_white = 1.05 / (lum + 0.05)
        on_dark = (lum + 0.05) / (_luminance(_linear("#111111")) + 0.05)
        assert min(on_white, on_dark) >= 1.8, f"{category} {hex_colour}: {on_white:.2f} on white, {on_dark:.2f} on #111"


# --- scale and markers ----------------------------------------------------------------------------------------
def test_capacity_marker_is_inside_the_bar_area_with_room_past_it() -> None:
    s = scale_for([40 * MiB], 48 * MiB, capacity_label="budget")
    assert s.capacity == 48 * MiB and s.pct(s.capacity) < 97
    assert s.pct(40 * MiB) < s.pct(s.capacity)
    over = scale_for([40 * MiB, 60 * MiB], 48 * MiB)
    assert over.pct(60 * MiB) <= 100 and over.pct(48 * MiB) < over.pct(60 * MiB)


def test_small_use_of_a_large_capacity_is_zoomed_in() -> None:
    t4 = 15 * 2**30
    s = scale_for([57 * MiB], t4)
    assert s.capacity is None and s.zoomed_from == t4
    assert s.pct(57 * MiB) > 50, "the bar fills most of the width instead of a sliver"
    assert scale_for([int(ZOOM_FRACTION * t4) + 1], t4).capacity == t4


def test_session_scale_makes_bars_comparable_across_cells() -> None:
    small, large = scale_for([9 * MiB], session=40 * MiB), scale_for([40 * MiB], session=40 * MiB)
    assert small.top == large.top and small.pct(8 * MiB) == large.pct(8 * MiB)


@pytest.fixture
def model_and_data() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    return {"model": model, "opt": torch.optim.AdamW(model.parameters()), "x": torch.randn(128, 512)}


def test_oom_request_is_drawn_past_the_budget(model_and_data: dict) -> None:
    ns = model_and_data
    m = vram_magic.measure(budget="24MiB", namespace=ns)
    with pytest.raises(torch.OutOfMemoryError), m:
        ns["hs"] = []
        for _ in range(40):
            ns["hs"].append(ns["model"](ns["x"]))
    report = m.report
    html = report_html(report)
    scale = report_scale(report)
    request = re.search(r'class="vram-extra vram-request"[^>]*style="[^"]*left:([\d.]+)%;width:([\d.]+)%', html)
    assert request, "the failed request is drawn"
    end = float(request.group(1)) + float(request.group(2))
    assert end > scale.pct(24 * MiB) > 0, f"request ends at {end:.1f} %, budget at {scale.pct(24 * MiB):.1f} %"
    assert 'class="vram-limit"' in html and "budget 24.0\u00a0MiB" in html
    assert "Out of memory" in html


# --- text and tables ------------------------------------------------------------------------------------------
def test_tiny_changes_read_as_unchanged(shell) -> None:
    run_ok(shell, "import torch\nbig = torch.zeros(2**20)")
    run_ok(shell, "%%vram -o r1 -q\nbig += 1")
    run_ok(shell, "%%vram -o r2 -q\ntiny = torch.zeros(1)")  # 4 bytes more than the cell before
    r2 = shell.user_ns["r2"]
    assert r2.delta.total == 4
    delta_line = next(line for line in report_text(r2).splitlines() if line.startswith("Δ vs"))
    assert "+4 B" not in delta_line and delta_line.split()[-1] == "±0"
    html = report_html(r2)
    assert ">+4\u00a0B<" not in html and 'class="vram-same"' in html and "(+4 bytes): below the threshold" in html


def test_advice_shows_code_as_code(shell) -> None:
    run_ok(shell, "import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), "
                  "torch.nn.Linear(1024, 512))\nx = torch.randn(256, 512)")
    run_ok(shell, "%%vram -o r -q\nh = model(x)")
    html = report_html(shell.user_ns["r"])
    advice = html[html.index('class="vram-advice"'):]
    assert "<code>del h</code>" in advice and "`" not in advice


def test_sanitized_html_keeps_the_bars_as_text_and_escapes_nothing(shell, model_and_data: dict) -> None:
    """nbconvert --sanitize-html keeps only a few tags and no styles, and escapes every other tag."""
    from nbconvert.filters.strings import clean_html

    shell.user_ns.update(model_and_data)
    run_ok(shell, "%%vram -o r -q\nloss = model(x).sum()\nloss.backward()\nopt.step()")
    est = vram_magic.estimate(model_and_data["model"], torch.randn(64, 512), gpu="T4", what_if=True)
    frame = shell.run_line_magic("vram", "history")
    for markup in (report_html(shell.user_ns["r"]), est._repr_mimebundle_()["text/html"], frame._repr_html_()):
        assert not re.search(r"<(table|svg|style|script|th|thead|tbody|p|br)\b", markup)
        clean = clean_html(markup)
        assert "&lt;" not in clean, clean[clean.index("&lt;") - 80:clean.index("&lt;") + 80]
    clean = clean_html(report_html(shell.user_ns["r"]))
    bars = re.findall(r'class="vram-textbar">(.*?)</span>\s*</span>', clean)
    letters = [re.sub(r"<[^>]+>", "", b) for b in bars]
    assert len(letters) == 3 and all(len(t) == 42 and t[0] == t[-1] == "|" for t in letters)
    assert "PPP" in letters[2] and "GGG" in letters[2] and "OOO" in letters[2]


def test_reports_are_static_html_and_text(shell) -> None:
    run_ok(shell, "import torch\nt = torch.zeros(1000)")
    with capture_output() as cap:
        run_ok(shell, "%%vram\nu = t * 2")
    bundles = [o.data for o in cap.outputs]
    assert len(bundles) == 1 and set(bundles[0]) == {"text/plain", "text/html"}
    assert 'class="vram-report"' in bundles[0]["text/html"]
    assert set(report_bundle(shell._vram_magic_extension.session.last)) == {"text/plain", "text/html"}


def test_traceback_starts_at_the_cells_code(shell, capsys) -> None:
    result = run(shell, "%%vram -q\nx = 1\nraise ValueError('from the cell')")
    assert isinstance(result.error_in_exec, ValueError)
    printed = capsys.readouterr().out
    assert "run_cell_magic" not in printed and "raise ValueError('from the cell')" in printed
    assert printed.index("ValueError") < printed.index("raise ValueError")


def test_history_and_diff_show_units_and_keep_bytes(shell) -> None:
    import pandas as pd

    run_ok(shell, "import torch\na = torch.zeros(2**20)")
    run_ok(shell, "%%vram -q\nb = torch.zeros(2**21)")
    run_ok(shell, "%%vram -q\nc = torch.zeros(2**19)")
    frame = shell.run_line_magic("vram", "history")
    assert isinstance(frame, pd.DataFrame) and frame["other"].tolist()[-1] == (2**20 + 2**21 + 2**19) * F32
    assert "14.0 MiB" in repr(frame) and "14680064" not in repr(frame)
    assert "14.0\u00a0MiB" in frame._repr_html_() and 'overflow-x:auto' in frame._repr_html_()
    derived = frame[["other"]] / MiB
    assert type(derived) is pd.DataFrame and "14.0" in repr(derived)
    diff = shell.run_line_magic("vram", "diff")
    assert diff.loc["change", "other"] == 2**19 * F32 and "+2.00 MiB" in repr(diff)


# --- estimates ------------------------------------------------------------------------------------------------
def test_estimate_that_fits_easily_is_zoomed_with_its_share() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    est = vram_magic.estimate(model, torch.randn(32, 256), gpu="T4", what_if=True)
    html = est._repr_mimebundle_()["text/html"]
    assert re.search(r"bars zoomed in: [\d.]+\u00a0MiB is [\d.]+ % of T4", html)
    assert 'class="vram-limit"' not in html
    # module names as paths, never a bare index
    assert f"<code>{est.model}.1</code>" in html and "after the forward: 1 " not in str(est)
    # the what-if table: headed, sorted by the memory saved
    head = re.search(r'class="vram-what-if-head".*?</div>', html).group(0)
    assert [re.sub(r"<[^>]+>|\s", "", c) for c in re.findall(r"<span[^>]*>(.*?)</span>", head)] == [
        "whatif", "peak", "needed", "saves", "compute", "steps", "fits", "note"]
    order = [r.saving for r in est.strategies[1:]]
    shown = [r for r in est.strategies[1:]]
    shown.sort(key=lambda r: r.saving)
    names = re.findall(r'class="vram-what-if-row".*?<span[^>]*>([^<]*?)\s*</span>', html)
    assert names[0] == est.strategies[0].name and names[1:] == [r.name for r in shown], (names, order)
    assert 'class="vram-fits"' in html and "✔ fits" in html


def test_estimate_that_does_not_fit_shows_how_far_it_overflows() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    est = vram_magic.estimate(model, torch.randn(4096, 256), budget="16MiB", device="cpu")
    assert est.fits is False
    html = est._repr_mimebundle_()["text/html"]
    short = est.needed - est.capacity
    assert f"{vram_magic.core.units.format_bytes(short)} over the budget".replace(" ", "\u00a0", 1) in html
    scale = scale_for([est.needed, est.peak.total, est.after_forward.total], est.capacity)
    assert scale.capacity == est.capacity and scale.pct(est.needed) > scale.pct(est.capacity)


# --- the timeline ---------------------------------------------------------------------------------------------
def test_timeline_phase_bands_labels_apart_and_transparent(model_and_data: dict) -> None:
    import io

    from matplotlib.image import imread

    from vram_magic.measuring.render.timeline import figure_png, phase_runs, text_boxes

    ns = model_and_data
    with vram_magic.measure(namespace=ns, budget="64MiB") as m:
        for _ in range(2):
            loss = ns["model"](ns["x"]).pow(2).mean()
            loss.backward()
            ns["opt"].step()
            ns["opt"].zero_grad(set_to_none=True)
    phases = [p for p, _, _ in phase_runs(m.report) if p != "cell"]
    # the loss is computed outside the model after its forward (.pow(2).mean()): a phase of its own
    assert phases[:4] == ["forward", "loss", "backward", "optimizer"] and phases.count("forward") == 2
    fig = m.report.timeline()
    boxes = text_boxes(fig)
    assert len(boxes) >= 15
    for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
        assert not (ba.x0 < bb.x1 and bb.x0 < ba.x1 and ba.y0 < bb.y1 and bb.y0 < ba.y1), f"{a!r} overlaps {b!r}"
    image = imread(io.BytesIO(figure_png(fig)))
    assert image.shape[2] == 4 and image[0, 0, 3] == 0 and image[-1, -1, 3] == 0, "a transparent background"
    assert any(t.startswith("largest allocations") for t, _ in boxes)
