"""Checks of the depth-map pictures as a person sees them, shared by the depth-map and demo tests: token boxes counted
in a PNG by colour, and the HTML page rendered in headless Chromium."""

import json
import os
import re
import subprocess
import tempfile

import numpy as np
import pytest

from hf_loops.analysis.depth_map import chromium_args, depth_palette, find_chromium


def _count_boxes(img, rgb, min_pixels=30, close=2):
    """Connected regions of exactly colour `rgb` with at least `min_pixels` pixels (glyph counters are smaller).
    Growing the regions by `close` pixels heals boxes that a full-height (`|`) or full-width (`↵`) glyph stroke cuts
    in two; the gaps between token boxes (one character cell, 30% of a line) are wider than 2 * close."""
    mask = (np.abs(img[..., :3].astype(int) - np.array(rgb)) <= 1).all(-1)
    for _ in range(close):
        grown = mask.copy()
        grown[:, 1:] |= mask[:, :-1]
        grown[:, :-1] |= mask[:, 1:]
        grown[1:] |= mask[:-1]
        grown[:-1] |= mask[1:]
        mask = grown
    big = mask.size
    lab = np.where(mask, np.arange(mask.size).reshape(mask.shape), big)
    while True:
        new = lab.copy()
        new[1:] = np.minimum(new[1:], lab[:-1])
        new[:-1] = np.minimum(new[:-1], lab[1:])
        new[:, 1:] = np.minimum(new[:, 1:], lab[:, :-1])
        new[:, :-1] = np.minimum(new[:, :-1], lab[:, 1:])
        new = np.where(mask, new, big)
        if (new == lab).all():
            break
        lab = new
    _, counts = np.unique(lab[mask], return_counts=True)
    return int((counts >= min_pixels).sum())


def png_box_counts(path, max_depth):
    """{depth: number of token boxes of that colour} in a depth-map PNG."""
    from matplotlib.image import imread

    img = (imread(path) * 255).round().astype(int)
    out = {}
    for d, color in depth_palette(max_depth).items():
        out[d] = _count_boxes(img, [int(color[i:i + 2], 16) for i in (1, 3, 5)])
    return out


def chromium_render_check(html_path):
    """Open `html_path` in headless Chromium; return what the rendered page reports for its token spans: count,
    visible boxes, computed background colour per depth, tooltips."""
    browser = find_chromium()
    if browser is None:
        pytest.skip("headless Chromium is not installed (Debian package `chromium`; .ci/run installs it)")
    probe = """<script>
window.addEventListener('load', () => {
  const toks = [...document.querySelectorAll('section span.tok')];
  const out = {tokens: toks.length, visible: 0, titled: 0, colors: {}};
  for (const s of toks) {
    const r = s.getBoundingClientRect();
    if (r.width > 0 && r.height > 0) out.visible++;
    if (s.title.includes('depth ' + s.dataset.depth)) out.titled++;
    const bg = getComputedStyle(s).backgroundColor, d = s.dataset.depth;
    out.colors[d] = out.colors[d] || {};
    out.colors[d][bg] = (out.colors[d][bg] || 0) + 1;
  }
  const pre = document.createElement('pre'); pre.id = 'render-check'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""
    with open(html_path, encoding="utf-8") as f:
        page = f.read()
    with tempfile.TemporaryDirectory() as tmp:
        probed = os.path.join(tmp, "page.html")
        with open(probed, "w", encoding="utf-8") as f:
            f.write(page.replace("</body>", probe + "</body>"))
        res = subprocess.run(chromium_args(browser) + [f"--user-data-dir={tmp}/profile", "--dump-dom",
                                                       "--virtual-time-budget=3000", "file://" + probed],
                             capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="render-check">(.*?)</pre>', res.stdout, re.S)
    assert m, f"Chromium did not render the page: {res.stderr[-500:]}"
    return json.loads(m.group(1).replace("&quot;", '"'))


def expected_colors(max_depth):
    return {str(d): f"rgb({int(c[1:3], 16)}, {int(c[3:5], 16)}, {int(c[5:7], 16)})"
            for d, c in depth_palette(max_depth).items()}
