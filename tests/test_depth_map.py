"""Per-token depth map (analysis.md §5.1): token classes, span means, HTML/ANSI/PNG renderings, headless Chromium."""

import json
import os
import re
import subprocess
import tempfile
from html.parser import HTMLParser

import numpy as np
import pytest

from hf_loops.analysis.depth_map import (
    chromium_args,
    class_depth_stats,
    depth_map,
    depth_palette,
    find_chromium,
    group_deep_share,
    render_ansi,
    render_html,
    render_png,
    token_class,
)


def _row():
    tokens = ["Tom", " has", " 12", "+", "3", " apples", ".", "\n", "####", " 15", "<|im_end|>"]  # `|`: full height
    depths = [1, 1, 2, 2, 1, 1, 1, 1, 2, 2, 1]
    probs = [[0.2], [0.3], [0.8], [0.9], [0.1], [0.4], [0.2], [0.1], [0.7], [0.6], [float("nan")]]
    special = [False] * 10 + [True]
    return depth_map(tokens, depths, probs, special=special, spans=[("reasoning", 0, 8), ("final", 8, 11)],
                     label="example")


@pytest.mark.parametrize("text, cls", [
    ("123", "digits"), (" 4,000", "digits"), ("3.5", "digits"), ("+", "operators"), ("<<", "operators"),
    (" =", "operators"), (" the", "words"), ("'s", "words"), ("don't", "words"), (".", "punctuation"),
    ("$", "punctuation"), ("####", "punctuation"), ("\n", "other"), ("10%", "other"), (" apples.", "other"),
])
def test_token_class_rule(text, cls):
    assert token_class(text) == cls


def test_special_tokens_are_other_and_stats_follow_the_rule():
    assert token_class("<|im_end|>", special=True) == "other"
    row = _row()
    stats = row.class_stats()  # the special token is not scored
    assert stats["digits"] == {"tokens": 3, "mean_depth": 5 / 3, "deep_share": 2 / 3}
    assert stats["operators"] == {"tokens": 1, "mean_depth": 2.0, "deep_share": 1.0}
    assert stats["words"]["tokens"] == 3 and stats["words"]["deep_share"] == 0.0
    assert stats["punctuation"]["tokens"] == 2 and stats["other"]["tokens"] == 1
    assert group_deep_share(stats, ("digits", "operators")) == 0.75
    assert row.mean_depth() == pytest.approx(sum([1, 1, 2, 2, 1, 1, 1, 1, 2, 2]) / 10)
    assert row.span_means() == [("reasoning", 1.25, 8), ("final", pytest.approx(5 / 3), 3)]
    empty = class_depth_stats([], [])
    assert empty["digits"] == {"tokens": 0, "mean_depth": None, "deep_share": None}


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match="depths"):
        depth_map(["a", "b"], [1])
    with pytest.raises(ValueError, match="span"):
        depth_map(["a"], [1], spans=[("x", 0, 2)])


class _Spans(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tokens = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and "data-depth" in a:
            self.tokens.append(a)


def test_html_has_one_span_per_token_with_depth_class_and_tooltip():
    row = _row()
    page = render_html([row], 2, title="t")
    parser = _Spans()
    parser.feed(page)
    assert len(parser.tokens) == len(row.tokens)
    for a, d, g in zip(parser.tokens, row.depths, row.continue_probs):
        assert f"d{d}" in a["class"].split() and a["data-depth"] == str(d)
        assert f"depth {d} of 2" in a["title"]
        if g[0] is not None:
            assert f"continue p after depth 1: {g[0]:.3f}" in a["title"]
    for d, color in depth_palette(2).items():
        assert f"span.tok.d{d} {{ background: {color}" in page
    assert "1.25" in page and "mean depth" in page


def test_ansi_colours_every_token():
    text = render_ansi([_row()], 2)
    assert len(re.findall(r"\x1b\[48;2;", text)) == len(_row().tokens) + 2  # tokens + the 2-entry legend


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


def test_png_colours_every_token(tmp_path):
    row = _row()
    boxes = render_png([row, row], 2, str(tmp_path / "m.png"))
    assert boxes == 2 * len(row.tokens)
    counts = png_box_counts(tmp_path / "m.png", 2)
    # + 1 box per depth for the legend patches
    assert counts == {1: 2 * row.depths.count(1) + 1, 2: 2 * row.depths.count(2) + 1}


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


def test_html_renders_in_headless_chromium(tmp_path):
    row = _row()
    path = tmp_path / "m.html"
    path.write_text(render_html([row, row], 2), encoding="utf-8")
    check = chromium_render_check(path)
    n = 2 * len(row.tokens)
    assert check["tokens"] == check["visible"] == check["titled"] == n
    want = expected_colors(2)
    assert check["colors"] == {d: {want[d]: 2 * row.depths.count(int(d))} for d in ("1", "2")}
