"""Per-token depth maps (the paper's Fig. 11; docs/analysis.md): every token shaded by the depth that produced
it, as HTML (hover shows depth and continue probabilities), PNG and ANSI; span means; mean depth per token class.

Convention (same as `hf_loops.inference.generate_with_depths`): token t is coloured by the depth the model spent to
*predict* it, i.e. the executed depth m of position t − 1. So "the model iterated twice on this digit" means the
distribution this digit was read from came from two passes.

The token-class rule lives here and only here (`token_class`): digits, operators, words, punctuation, other
(whitespace, special tokens, mixed).
"""

from __future__ import annotations

import html
import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field

TOKEN_CLASSES = ("digits", "operators", "words", "punctuation", "other")
OPERATOR_CHARS = frozenset("+-*/=<>^%×÷")
_DIGITS = re.compile(r"^[0-9]+(?:[.,][0-9]+)*$")
_WORD = re.compile(r"^['’]?[^\W\d_]+(?:['’][^\W\d_]+)*$")


def token_class(text: str, special: bool = False) -> str:
    """The class of one token's text: "digits" (0-9, with inner . or ,), "operators" (only + - * / = < > ^ % × ÷),
    "words" (letters, inner apostrophes), "punctuation" (only punctuation/symbols), else "other" (whitespace,
    special tokens, mixed). Surrounding whitespace is ignored."""
    s = text.strip()
    if special or not s:
        return "other"
    if _DIGITS.match(s):
        return "digits"
    if all(c in OPERATOR_CHARS for c in s):
        return "operators"
    if _WORD.match(s):
        return "words"
    if all(unicodedata.category(c)[0] in "PS" for c in s):
        return "punctuation"
    return "other"


def is_deep(depth: int) -> bool:
    """A "deep" token needed more than one pass."""
    return depth >= 2


def class_depth_stats(texts: Sequence[str], depths: Sequence[int], special: Sequence[bool] | None = None) -> dict:
    """Per token class: token count, mean depth and the share of deep (depth >= 2) tokens (None when empty)."""
    sums = {c: [0, 0.0, 0] for c in TOKEN_CLASSES}
    for i, (text, d) in enumerate(zip(texts, depths, strict=True)):
        c = token_class(text, bool(special[i]) if special is not None else False)
        sums[c][0] += 1
        sums[c][1] += d
        sums[c][2] += is_deep(d)
    return {c: {"tokens": n, "mean_depth": (s / n if n else None), "deep_share": (k / n if n else None)}
            for c, (n, s, k) in sums.items()}


def merge_class_stats(stats: Sequence[dict]) -> dict:
    """Token-weighted merge of several `class_depth_stats` results."""
    out = {}
    for c in TOKEN_CLASSES:
        n = sum(s[c]["tokens"] for s in stats)
        depth = sum((s[c]["mean_depth"] or 0.0) * s[c]["tokens"] for s in stats)
        deep = sum((s[c]["deep_share"] or 0.0) * s[c]["tokens"] for s in stats)
        out[c] = {"tokens": n, "mean_depth": depth / n if n else None, "deep_share": deep / n if n else None}
    return out


def group_deep_share(stats: dict, classes: Sequence[str]) -> float | None:
    """Share of deep tokens over the union of `classes` (e.g. digits + operators)."""
    n = sum(stats[c]["tokens"] for c in classes)
    if not n:
        return None
    return sum((stats[c]["deep_share"] or 0.0) * stats[c]["tokens"] for c in classes) / n


# ----------------------------------------------------------------------------------------------------- data
@dataclass
class DepthMapRow:
    """One displayed sequence: token texts, their depths, optional continue probabilities (one list of M − 1 values
    per token, NaN/None where not executed), a prompt mask (dimmed), special-token flags and named spans
    `(label, start, end)` over token indices (half-open) whose mean depth is reported."""

    tokens: list[str]
    depths: list[int]
    continue_probs: list[list[float | None]] | None = None
    prompt: list[bool] | None = None
    special: list[bool] | None = None
    spans: list[tuple[str, int, int]] = field(default_factory=list)
    label: str = ""

    def __post_init__(self):
        n = len(self.tokens)
        for name in ("depths", "continue_probs", "prompt", "special"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"DepthMapRow.{name} has {len(value)} entries for {n} tokens")
        for label, start, end in self.spans:
            if not 0 <= start <= end <= n:
                raise ValueError(f"span {label!r} [{start}, {end}) lies outside the {n} tokens")

    def scored(self) -> list[int]:
        """Indices of the tokens that count in means (not prompt, not special)."""
        return [i for i in range(len(self.tokens))
                if not (self.prompt and self.prompt[i]) and not (self.special and self.special[i])]

    def mean_depth(self) -> float | None:
        idx = self.scored()
        return sum(self.depths[i] for i in idx) / len(idx) if idx else None

    def span_means(self) -> list[tuple[str, float | None, int]]:
        """(label, mean depth, token count) of every span."""
        out = []
        for label, start, end in self.spans:
            d = self.depths[start:end]
            out.append((label, sum(d) / len(d) if d else None, len(d)))
        return out

    def class_stats(self) -> dict:
        idx = self.scored()
        return class_depth_stats([self.tokens[i] for i in idx], [self.depths[i] for i in idx])


def depth_map(tokens: Sequence[str], depths: Sequence[int], continue_probs=None, prompt=None, special=None,
              spans=None, label: str = "") -> DepthMapRow:
    """One depth-map row (see `DepthMapRow`); render rows with `render_html`, `render_png`, `render_ansi`."""
    def plain(x):  # tensors and arrays become lists
        return x.tolist() if hasattr(x, "tolist") else x

    cp = None
    if continue_probs is not None:
        cp = [[None if v is None or math.isnan(float(v)) else float(v) for v in plain(row)]
              for row in plain(continue_probs)]
    depths = plain(depths)
    return DepthMapRow(list(tokens), [int(d) for d in depths], cp, list(prompt) if prompt is not None else None,
                       list(special) if special is not None else None, list(spans or []), label)


# ----------------------------------------------------------------------------------------------------- colours
_LIGHT, _DARK = (0xE3, 0xE9, 0xF2), (0xC4, 0x4E, 0x12)  # depth 1 pale grey-blue → depth M burnt orange


def depth_color(depth: int, max_depth: int) -> str:
    """Hex background colour of `depth` on a ramp with `max_depth` levels (darker = more iterations)."""
    if max_depth <= 1:
        t = 0.0
    else:
        t = (min(max(depth, 1), max_depth) - 1) / (max_depth - 1)
    rgb = [round(a + (b - a) * t) for a, b in zip(_LIGHT, _DARK, strict=True)]
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def depth_palette(max_depth: int) -> dict[int, str]:
    return {d: depth_color(d, max_depth) for d in range(1, max(max_depth, 1) + 1)}


def _text_color(hex_color: str) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return "#ffffff" if 0.299 * r + 0.587 * g + 0.114 * b < 140 else "#1a1a1a"


def _display(text: str) -> str:
    """Visible form of a token: newlines as ↵, tabs as →."""
    return text.replace("\r", "").replace("\n", "↵").replace("\t", "→")


def _tooltip(row: DepthMapRow, i: int, max_depth: int) -> str:
    parts = [f"{row.tokens[i]!r}", f"depth {row.depths[i]} of {max_depth}"]
    if row.continue_probs is not None:
        for m, g in enumerate(row.continue_probs[i], start=1):
            if g is not None:
                parts.append(f"continue p after depth {m}: {g:.3f}")
    parts.append(f"class: {token_class(row.tokens[i], bool(row.special and row.special[i]))}")
    if row.prompt and row.prompt[i]:
        parts.append("prompt")
    return " · ".join(parts)


# ----------------------------------------------------------------------------------------------------- HTML
_CSS = """
body { font: 15px/1.5 system-ui, sans-serif; margin: 24px auto; max-width: 1100px; color: #1a1a1a; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 15px; margin: 18px 0 6px; }
p.note { color: #555; margin: 2px 0 10px; }
.legend span.tok { margin-right: 10px; }
.text { font: 14px/1.9 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
span.tok { white-space: pre-wrap; border-radius: 3px; padding: 1px 0; margin: 0 1px 0 0; cursor: help; }
span.tok.prompt { opacity: 0.45; }
span.tok:hover { outline: 2px solid #222; }
table.spans { border-collapse: collapse; font-size: 13px; margin-top: 6px; }
table.spans td, table.spans th { border: 1px solid #ddd; padding: 2px 8px; text-align: left; }
"""


def render_html(rows: Sequence[DepthMapRow], max_depth: int, title: str = "Per-token depth map",
                note: str = "") -> str:
    """A self-contained HTML page: one section per row, one `<span class="tok">` per token with its depth colour,
    `data-depth`, `data-g` and a `title` tooltip (depth and continue probabilities)."""
    palette = depth_palette(max_depth)
    css = _CSS + "".join(
        f"span.tok.d{d} {{ background: {c}; color: {_text_color(c)}; }}\n" for d, c in palette.items()
    )
    out = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{html.escape(title)}</title><style>{css}</style></head><body>",
           f"<h1>{html.escape(title)}</h1>"]
    if note:
        out.append(f'<p class="note">{html.escape(note)}</p>')
    legend = "".join(f'<span class="tok d{d}" title="depth {d}">&nbsp;depth {d}&nbsp;</span>' for d in palette)
    out.append(f'<p class="legend">{legend} (hover a token for its depth and continue probabilities; dimmed = '
               "prompt)</p>")
    for k, row in enumerate(rows):
        mean = row.mean_depth()
        head = html.escape(row.label or f"sequence {k + 1}")
        if mean is not None:
            head += f" · mean depth {mean:.2f}"
        out.append(f'<section class="example" data-example="{k}"><h2>{head}</h2><div class="text">')
        for i, text in enumerate(row.tokens):
            d = row.depths[i]
            classes = f"tok d{min(max(d, 1), max_depth)}" + (" prompt" if row.prompt and row.prompt[i] else "")
            g = ""
            if row.continue_probs is not None:
                g = ",".join("" if v is None else f"{v:.4f}" for v in row.continue_probs[i])
            out.append(f'<span class="{classes}" data-depth="{d}" data-g="{g}" '
                       f'title="{html.escape(_tooltip(row, i, max_depth))}">{html.escape(_display(text))}</span>')
            if "\n" in text:
                out.append("<br>")
        out.append("</div>")
        if row.spans:
            out.append('<table class="spans"><tr><th>span</th><th>tokens</th><th>mean depth</th></tr>')
            for label, m, n in row.span_means():
                out.append(f"<tr><td>{html.escape(label)}</td><td>{n}</td>"
                           f"<td>{'–' if m is None else f'{m:.2f}'}</td></tr>")
            out.append("</table>")
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------- ANSI
def render_ansi(rows: Sequence[DepthMapRow], max_depth: int) -> str:
    """Depth map for a true-colour terminal: background = depth colour, one line per row label."""
    palette = depth_palette(max_depth)
    lines = []
    for k, row in enumerate(rows):
        mean = row.mean_depth()
        lines.append(f"{row.label or f'sequence {k + 1}'}" + (f" (mean depth {mean:.2f})" if mean is not None else ""))
        parts = []
        for i, text in enumerate(row.tokens):
            c = palette[min(max(row.depths[i], 1), max_depth)]
            fg = _text_color(c)
            bg = ";".join(str(int(c[j:j + 2], 16)) for j in (1, 3, 5))
            fgc = ";".join(str(int(fg[j:j + 2], 16)) for j in (1, 3, 5))
            dim = "\x1b[2m" if row.prompt and row.prompt[i] else ""
            parts.append(f"{dim}\x1b[48;2;{bg}m\x1b[38;2;{fgc}m{_display(text)}\x1b[0m")
            if "\n" in text:
                parts.append("\n")
        lines.append("".join(parts))
    legend = " ".join(
        f"\x1b[48;2;{';'.join(str(int(c[j:j + 2], 16)) for j in (1, 3, 5))}m depth {d} \x1b[0m"
        for d, c in palette.items()
    )
    lines.append(legend)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- PNG
def layout_tokens(rows: Sequence[DepthMapRow], width_chars: int = 96) -> list[list[tuple[int, int, int, str]]]:
    """Line-wrapped layout: per row, a list of (token index, line, column, display text) in character cells."""
    layout = []
    for row in rows:
        items, line, col = [], 0, 0
        for i, text in enumerate(row.tokens):
            shown = _display(text)
            w = max(len(shown), 1)
            if col > 0 and col + w > width_chars:
                line, col = line + 1, 0
            items.append((i, line, col, shown))
            col += w + 1  # one blank cell keeps neighbouring boxes apart
            if "\n" in text:
                line, col = line + 1, 0
        layout.append(items)
    return layout


def render_png(rows: Sequence[DepthMapRow], max_depth: int, path: str, title: str = "Per-token depth map",
               width_chars: int = 96, dpi: int = 110) -> int:
    """Draw the depth map with matplotlib (one box per token, the depth colour as background, a gap between boxes).
    Returns the number of token boxes drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    palette = depth_palette(max_depth)
    layout = layout_tokens(rows, width_chars)
    cell_w, line_h = 0.62, 1.9  # in font-size units (monospace cell width, line pitch)
    font = 8.0
    header = 1.6
    total_lines = sum((items[-1][1] + 1 if items else 1) for items in layout) + header * len(rows)
    fig_w = (width_chars * cell_w * font + 40) / 72
    fig_h = (total_lines * line_h * font + 60) / 72
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=dpi)
    ax = fig.add_axes([0.01, 0.01, 0.98, 0.92])
    ax.set_xlim(0, width_chars * cell_w)
    ax.set_ylim(total_lines * line_h, 0)
    ax.axis("off")
    fig.suptitle(title, fontsize=10, x=0.01, ha="left", y=0.995)
    y0, boxes = 0.0, 0
    for row, items in zip(rows, layout, strict=True):
        mean = row.mean_depth()
        suffix = f"  (mean depth {mean:.2f})" if mean is not None else ""
        room = int(width_chars * 0.95) - len(suffix)  # bold proportional text: about one cell per character
        label = (row.label if len(row.label) <= room else row.label[:max(room - 1, 0)] + "…") + suffix
        ax.text(0, y0 + 0.9 * line_h, label, fontsize=font, fontweight="bold", va="center", family="DejaVu Sans")
        y0 += header * line_h
        for i, line, col, shown in items:
            d = min(max(row.depths[i], 1), max_depth)
            color = palette[d]
            y = y0 + line * line_h
            ax.add_patch(Rectangle((col * cell_w, y + 0.15 * line_h), max(len(shown), 1) * cell_w, 0.7 * line_h,
                                   facecolor=color, edgecolor="none", alpha=0.45 if row.prompt and row.prompt[i] else 1))
            ax.text(col * cell_w, y + 0.5 * line_h, shown, fontsize=font, family="DejaVu Sans Mono", va="center",
                    color=_text_color(color))
            boxes += 1
        y0 += ((items[-1][1] + 1) if items else 1) * line_h
    handles = [Patch(facecolor=c, label=f"depth {d}") for d, c in palette.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return boxes


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome executable, or None."""
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium_args(browser: str) -> list[str]:
    """Headless Chromium flags that work in containers (no sandbox as root, no GPU, no first-run UI)."""
    import os

    args = [browser, "--headless", "--disable-gpu", "--hide-scrollbars", "--no-first-run", "--mute-audio"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--no-sandbox")
    return args


def screenshot_html(html_path: str, png_path: str, width: int = 1200, height: int = 900, timeout: float = 60) -> None:
    """Render `html_path` in headless Chromium and save a screenshot (raises RuntimeError without Chromium)."""
    import os
    import subprocess
    import tempfile

    browser = find_chromium()
    if browser is None:
        raise RuntimeError("no Chromium executable found (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(chromium_args(browser) + [f"--user-data-dir={profile}", f"--window-size={width},{height}",
                                                 f"--screenshot={os.path.abspath(png_path)}",
                                                 "file://" + os.path.abspath(html_path)],
                       check=True, capture_output=True, timeout=timeout)


def plot_depth_by_class(stats_by_model: dict[str, dict], path: str, title: str = "Mean depth by token class") -> None:
    """Grouped bars: mean depth of digits, operators, words, punctuation for each model (token counts on top)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = ("digits", "operators", "words", "punctuation")
    names = list(stats_by_model)
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    width = 0.8 / max(len(names), 1)
    colors = ["#8fa3bf", "#c44e12", "#4c956c", "#7b2cbf"]
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(classes))]
        vals = [stats_by_model[name][c]["mean_depth"] or 0.0 for c in classes]
        bars = ax.bar(xs, vals, width, label=name, color=colors[k % len(colors)])
        for b, c in zip(bars, classes, strict=True):
            n = stats_by_model[name][c]["tokens"]
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"n={n}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(classes)), classes)
    ax.set_ylabel("mean depth (passes)")
    top = max([1.0] + [stats_by_model[n][c]["mean_depth"] or 0.0 for n in names for c in classes])
    ax.set_ylim(0, top * 1.15 + 0.05)
    ax.axhline(1.0, color="#999", lw=0.8, ls="--")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


__all__ = [
    "OPERATOR_CHARS",
    "TOKEN_CLASSES",
    "DepthMapRow",
    "class_depth_stats",
    "depth_color",
    "depth_map",
    "depth_palette",
    "find_chromium",
    "group_deep_share",
    "is_deep",
    "layout_tokens",
    "merge_class_stats",
    "plot_depth_by_class",
    "render_ansi",
    "render_html",
    "render_png",
    "screenshot_html",
    "token_class",
]
