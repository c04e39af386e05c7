"""Per-token depth map (analysis.md §5.1): token classes, span means, HTML/ANSI/PNG renderings, headless Chromium."""

import re
from html.parser import HTMLParser

import pytest
from helpers.picture_helpers import chromium_render_check, expected_colors, png_box_counts

from hf_loops.analysis.depth_map import (
    class_depth_stats,
    depth_map,
    depth_palette,
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
    for a, d, g in zip(parser.tokens, row.depths, row.continue_probs, strict=False):
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


@pytest.mark.slow
def test_png_colours_every_token(tmp_path):
    row = _row()
    boxes = render_png([row, row], 2, str(tmp_path / "m.png"))
    assert boxes == 2 * len(row.tokens)
    counts = png_box_counts(tmp_path / "m.png", 2)
    # + 1 box per depth for the legend patches
    assert counts == {1: 2 * row.depths.count(1) + 1, 2: 2 * row.depths.count(2) + 1}


@pytest.mark.slow
def test_html_renders_in_headless_chromium(tmp_path):
    row = _row()
    path = tmp_path / "m.html"
    path.write_text(render_html([row, row], 2), encoding="utf-8")
    check = chromium_render_check(path)
    n = 2 * len(row.tokens)
    assert check["tokens"] == check["visible"] == check["titled"] == n
    want = expected_colors(2)
    assert check["colors"] == {d: {want[d]: 2 * row.depths.count(int(d))} for d in ("1", "2")}
