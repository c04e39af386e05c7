"""`hf-loops analyze CHECKPOINT`: run the analysis toolkit on a checkpoint and write figures, metrics.json and a short
report.md (defaults, docs/analysis.md: the 100 GSM8K test questions, recurrences as trained plus a 128-recurrence
fixed-point pass where the architecture can run it).

The output directory is written atomically (temporary sibling, renamed into place); a non-empty --out is refused
unless --overwrite.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import torch

from ..conversion.registry import ARCHITECTURES
from ..core.numbers import check_int
from ..core.outdir import atomic_output_dir, check_output_dir
from ..core.readers import read_json, read_jsonl, read_text_lines
from . import attention_metrics as am
from . import residual_metrics as rm
from .trace import capture_trace, recurrence_support_error

METRIC_GROUPS = ("attention", "residual", "fixed_point", "depth")
ILLUSTRATIVE_PROMPTS = ("Hello! I've been well. I hope that you're doing well.", "The square root of 16 is")
T_FP = 128
ATTENTION_STATS = {
    "entropy": "normalised attention entropy (mean over rows)",
    "entropy_last": "normalised attention entropy of the last row (SGT statistic)",
    "key_marginal_entropy": "normalised key-marginal entropy H_km / log L_t",
    "local_attention_mass": "local attention mass (window ⌈32 r_t⌉)",
    "colsum_concentration": "ColSum concentration C",
    "sink_rate": "sink rate (first token, τ = 0.3)",
    "mixing_score": "mixing score (mean raw row entropy, nats)",
}
RESIDUAL_STATS = {
    "norm_mean": "mean residual norm",
    "norm_first": "first-token residual norm",
    "matrix_entropy": "normalised matrix entropy",
}


# ----------------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------------


def default_dataset_path() -> str | None:
    """The vendored GSM8K test problems (hf_loops/data/gsm8k), when the package ships them."""
    from ..data import gsm8k_path

    here = gsm8k_path()
    return here if os.path.isfile(here) else None


_TEXT_FIELDS = ("question", "text", "prompt")


def _text_of(item, where: str, strings: bool) -> str:
    if strings and isinstance(item, str):
        return item
    field = next((k for k in _TEXT_FIELDS if isinstance(item, dict) and k in item), None)
    if field is None:
        kinds = "a string or an object" if strings else "a JSON object"
        raise ValueError(f"{where}: expected {kinds} with a 'question', 'text' or 'prompt' field")
    if not isinstance(item[field], str):
        raise ValueError(f"{where}: field {field!r} is {'null' if item[field] is None else type(item[field]).__name__}"
                         "; expected a string")
    return item[field]


def load_texts(path: str) -> list[str]:
    """Texts from a .jsonl (field question / text / prompt per line), a .json list, or a plain file (one per line);
    bytes that are not UTF-8, invalid JSON or a wrong type are named with the file and line."""
    if not os.path.exists(path) and not os.path.islink(path):
        raise ValueError(f"--dataset {path!r}: no such file")
    if path.endswith(".jsonl"):
        rows, lines = read_jsonl(path, "--dataset", objects=False)
        where = (lambda i: f"{path}:{lines[i]}") if lines else (lambda i: f"{path}: item {i + 1}")
        texts = [_text_of(r, where(i), strings=False) for i, r in enumerate(rows)]
    elif path.endswith(".json"):
        data = read_json(path, "--dataset", expect=list)
        texts = [_text_of(d, f"{path}: item {n}", strings=True) for n, d in enumerate(data)]
    else:
        texts = [line for _, line in read_text_lines(path, "--dataset")]
    if not texts:
        raise ValueError(f"{path}: no texts")
    return texts


class ByteTokenizer:
    """Bytes as tokens (ids 0..255), for byte-level toy models (`--tokenizer bytes`)."""

    bos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


class _CompactTokenizer:
    """A tokenizer whose ids are re-indexed densely (examples/pretrain_spiralformer.py --compact-vocab)."""

    def __init__(self, tokenizer, vocab_map: list[int]):
        self.tokenizer = tokenizer
        self.back = vocab_map
        self.index = {t: i for i, t in enumerate(vocab_map)}
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos_token_id = self.index.get(bos) if bos is not None else None

    def encode(self, text: str) -> list[int]:
        return [self.index[t] for t in _encode(self.tokenizer, text) if t in self.index]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([self.back[int(i)] for i in ids if 0 <= int(i) < len(self.back)])


def _encode(tokenizer, text: str) -> list[int]:
    if callable(tokenizer) and not isinstance(tokenizer, (ByteTokenizer, _CompactTokenizer)):
        return list(tokenizer(text)["input_ids"])
    return list(tokenizer.encode(text))


def load_model_and_tokenizer(checkpoint: str, tokenizer: str | None = None):
    from transformers import AutoTokenizer

    from ..core.loading import check_tokenizer_fits, load_causal_lm

    if not os.path.isdir(checkpoint):
        raise ValueError(f"checkpoint {checkpoint!r} is not a directory")
    model = load_causal_lm(checkpoint, torch.float32)  # a checkpoint lacking weights is refused, naming them
    if tokenizer == "bytes":
        tok = ByteTokenizer()
    else:
        source = tokenizer or checkpoint
        try:
            tok = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"no tokenizer at {source!r} (pass --tokenizer DIR, or --tokenizer bytes): "
                             f"{str(err).splitlines()[0]}") from None
    vocab_file = os.path.join(checkpoint, "compact_vocab.json")
    if tokenizer != "bytes" and not os.path.isfile(vocab_file):  # a compact vocabulary remaps the ids
        check_tokenizer_fits(tok, model.config.vocab_size, f"--tokenizer {tokenizer!r}" if tokenizer else "tokenizer")
    if os.path.isfile(vocab_file) and tokenizer != "bytes":
        with open(vocab_file) as f:
            tok = _CompactTokenizer(tok, json.load(f))
    return model, tok


# ----------------------------------------------------------------------------------------------------------------------
# Accumulation over sequences
# ----------------------------------------------------------------------------------------------------------------------


class _Mean:
    """Running mean of tensors (or floats) keyed by name."""

    def __init__(self):
        self.sum, self.n = {}, defaultdict(int)

    def add(self, key, value):
        value = torch.as_tensor(value, dtype=torch.float32).detach().cpu()
        self.sum[key] = value.clone() if key not in self.sum else self.sum[key] + value
        self.n[key] += 1

    def get(self, key):
        return self.sum[key] / self.n[key] if key in self.sum else None

    def keys(self):
        return list(self.sum)


def _step_key(s):
    return (s.stage, s.recurrence, s.layer, s.physical_layer)


def _attention_stats(step) -> dict:
    att = step.attention
    A = att.weights()
    m = att.masks()
    return {
        "entropy": am.attention_entropy(A, normalized=True, **m),
        "entropy_last": am.attention_entropy(A, rows="last", normalized=True, **m),
        "key_marginal_entropy": am.key_marginal_entropy(A, normalized=True, **m),
        "local_attention_mass": am.local_attention_mass(A, r_t=step.resolution, **m),
        "colsum_concentration": am.colsum_concentration(A, **m),
        "sink_rate": am.sink_rate(A, **m),
        "mixing_score": am.mixing_score(A, **m),
    }, A


def _tolist(x):
    if x is None:
        return None
    if torch.is_tensor(x):
        x = x.tolist()
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, list):
        return [_tolist(v) for v in x]
    return x


def _first_last_trend(curve: list[float]) -> float:
    return curve[-1] - curve[0] if len(curve) >= 2 else float("nan")


# ----------------------------------------------------------------------------------------------------------------------
# The analysis
# ----------------------------------------------------------------------------------------------------------------------


def analyze(model, tokenizer, texts: list[str], out: str, *, recurrences: int | None = None, metrics=None,
            fixed_point_recurrences: int = T_FP, max_length: int = 512, overwrite: bool = False,
            progress: bool = True, name: str = "model", max_depth_map_texts: int = 3, groupings=None) -> dict:
    """Analyse `model` on `texts`; write figures (PNG + SVG), metrics.json and report.md into `out` atomically.
    Returns the metrics dictionary."""
    metrics = tuple(metrics or METRIC_GROUPS)
    bad = [m for m in metrics if m not in METRIC_GROUPS]
    if bad:
        raise ValueError(f"--metrics: unknown {bad}; choose from {list(METRIC_GROUPS)}")
    check_output_dir(out, "--out", overwrite=overwrite, hint=" (pass --overwrite to replace it)")
    check_counts(recurrences, fixed_point_recurrences, max_length)
    if not texts:
        raise ValueError("no input texts")
    from . import plots  # fails early with a clear message when matplotlib is missing

    plots._plt()
    groupings = tuple(groupings or plots.GROUPINGS)
    bad = [g for g in groupings if g not in plots.GROUPINGS]
    if bad:
        raise ValueError(f"--grouping: unknown {bad}; choose from {list(plots.GROUPINGS)}")
    # temporary directory → renamed into place (an existing empty --out such as `.` is kept and filled), locked
    with atomic_output_dir(out, "--out", overwrite=overwrite, label="--out") as tmp:
        return _analyze_into(model, tokenizer, texts, tmp, recurrences, metrics, fixed_point_recurrences,
                             max_length, progress, name, max_depth_map_texts, groupings)


def check_counts(recurrences: int | None, fixed_point_recurrences: int, max_length: int) -> None:
    """The counts of an analysis: integers in range (an explicit value is never replaced by a default)."""
    if recurrences is not None:
        check_int("--recurrences", recurrences, 1)
    check_int("--fixed-point-recurrences", fixed_point_recurrences, 2)
    check_int("--max-length", max_length, 2)  # at least two tokens: the probes compare positions


# What one recorded float costs in a trace, with the copies the probes make of it (measured on the tiny test models:
# peak memory ≈ 2 × the recorded tensors).
_TRACE_COPIES = 2


def trace_bytes(config, recurrences: int, tokens: int, attention: bool) -> int:
    """An upper bound of the memory one trace of `recurrences` recurrences over `tokens` tokens records: every layer's
    residual (tokens × hidden) and, with attention, its probabilities (heads × tokens × tokens), in float32."""
    per_step = tokens * config.hidden_size + (config.num_attention_heads * tokens * tokens if attention else 0)
    return _TRACE_COPIES * 4 * recurrences * config.num_hidden_layers * per_step


def available_memory() -> int | None:
    """Bytes of memory available to this process now (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_trace_memory(config, what: str, recurrences: int, tokens: int, attention: bool,
                       available: int | None = None) -> None:
    """Refuse, before any trace, a recurrence count whose traces cannot fit in the memory available (the machine would
    run out of memory and kill the process, leaving nothing but a temporary folder)."""
    available = available_memory() if available is None else available
    if available is None:
        return
    need = trace_bytes(config, recurrences, tokens, attention)
    budget = int(0.8 * available)
    if need > budget:
        per = max(trace_bytes(config, 1, tokens, attention), 1)
        raise ValueError(f"{what} {recurrences} needs about {need / 2**30:.1f} GiB for one {tokens}-token trace, "
                         f"more than the {available / 2**30:.1f} GiB available; at most {budget // per} fit here "
                         "(or lower --max-length)")


def _progress(iterable, enabled: bool, desc: str):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, leave=False)


class _Accumulator:
    """Per-step statistics summed over every analysed sequence (one trace at a time)."""

    def __init__(self, model, metrics, recurrences, max_length):
        self.model, self.metrics = model, metrics
        self.model_type = model.config.model_type
        spec = ARCHITECTURES.get(self.model_type)
        self.cross_iteration = spec is not None and spec.cross_iteration_attention
        self.record = ("residual", "attention") if "attention" in metrics else ("residual",)
        self.recurrences, self.max_length = recurrences, max_length
        self.step_meta, self.att_mean, self.res_mean = {}, _Mean(), _Mean()
        self.head_values = defaultdict(list)  # (stat, step key) → per-sequence (H,) values, for dynamic heads
        self.succ, self.att_succ, self.att_sim, self.res_sim = _Mean(), _Mean(), _Mean(), _Mean()
        self.att_sim_labels = self.res_sim_labels = None
        self.cross_iter, self.truncated, self.R = [], 0, None

    def add(self, ids, device) -> None:
        trace = capture_trace(self.model, torch.tensor([ids], device=device), num_recurrences=self.recurrences,
                              max_length=self.max_length, record=self.record)
        self.truncated += int(trace.truncated)
        self.R = trace.num_recurrences
        for s in trace.steps:
            self._add_step(s)
        if "residual" in self.metrics:
            self._add_residual_dynamics(trace)
        if "attention" in self.metrics:
            self._add_attention_dynamics(trace)

    def _add_step(self, s) -> None:
        key = _step_key(s)
        self.step_meta.setdefault(key, {"stage": s.stage, "recurrence": s.recurrence, "layer": s.layer,
                                        "physical_layer": s.physical_layer, "label": s.label,
                                        "resolution": s.resolution, "index": s.index,
                                        "heads": list(s.attention.heads) if s.attention is not None else None})
        if s.residual is not None and "residual" in self.metrics:
            norms = rm.residual_norm(s.residual, s.valid)
            self.res_mean.add((key, "norm_mean"), norms["mean"])
            self.res_mean.add((key, "norm_first"), norms["first"])
            self.res_mean.add((key, "matrix_entropy"), rm.matrix_entropy(s.residual, s.valid, normalized=True))
        if s.attention is not None:
            stats, A = _attention_stats(s)
            for stat, v in stats.items():
                self.att_mean.add((key, stat), v)
                if stat in ("key_marginal_entropy", "local_attention_mass") and s.stage == "loop":
                    self.head_values[(stat, key)].append(v)
            if self.cross_iteration and s.recurrence == self.R and s.attention.key_iter is not None:
                mean, _ = am.cross_iteration_mass(A, s.attention.key_iter, num_streams=self.R, **s.attention.masks())
                self.cross_iter.append((s.layer, mean))

    def _add_residual_dynamics(self, trace) -> None:
        for ell in trace.loop_layers:
            try:
                X, v = trace.loop_residuals(ell)
            except ValueError:
                continue
            if X.shape[0] > 1:
                for kind in ("l2", "relative", "cosine"):
                    self.succ.add((ell, kind), rm.successive_difference(X, v, kind))
        residual_steps = [s for s in trace.steps if s.residual is not None]
        labels = [s.label for s in residual_steps]
        if self.res_sim_labels in (None, labels):
            self.res_sim_labels = labels
            self.res_sim.add("m", rm.residual_similarity_matrix([s.residual for s in residual_steps],
                                                                [s.valid for s in residual_steps]))

    def _add_attention_dynamics(self, trace) -> None:
        for ell, steps in trace.by_layer().items():
            steps = [s for s in steps if s.attention is not None]
            if len(steps) > 1 and len({s.attention.shape for s in steps}) == 1:
                ws = am.common_head_weights([s.attention for s in steps])
                m = steps[0].attention.masks()
                m.pop("visible")
                d = [am.attention_distance(ws[t], ws[t - 1], **m) for t in range(1, len(ws))]
                self.att_succ.add(ell, torch.stack(d))
        try:
            D, labels = am.attention_similarity_matrix(trace)
            if len(labels) > 1 and self.att_sim_labels in (None, labels):
                self.att_sim_labels = labels
                self.att_sim.add("m", D)
        except ValueError:
            pass

    @property
    def keys(self) -> list:
        return sorted(self.step_meta, key=lambda k: self.step_meta[k]["index"])

    def step_rows(self) -> list[dict]:
        rows = []
        for k in self.keys:
            row = dict(self.step_meta[k])
            row["attention"] = {stat: _tolist(self.att_mean.get((k, stat))) for stat in ATTENTION_STATS
                                if self.att_mean.get((k, stat)) is not None}
            row["residual"] = {stat: _tolist(self.res_mean.get((k, stat))) for stat in RESIDUAL_STATS
                               if self.res_mean.get((k, stat)) is not None}
            rows.append(row)
        return rows

    def table_of(self, getter, stat) -> list[dict]:
        rows = []
        for i, k in enumerate(self.keys):
            v = getter((k, stat))
            if v is None:
                continue
            m = self.step_meta[k]
            rows.append({"step": i, "stage": m["stage"], "recurrence": m["recurrence"], "layer": m["layer"],
                         "value": float(v.mean())})
        return rows


class _Figures:
    """Writes each figure (PNG + SVG) into the output folder and remembers what it shows, for report.md."""

    def __init__(self, out: str):
        from . import plots

        self.out, self.plots, self.described = out, plots, {}

    def __call__(self, fig_table, stem, description):
        fig, table = fig_table
        self.plots.save_figure(fig, os.path.join(self.out, stem))
        self.described[stem] = description
        return table


def _per_step_figures(acc: _Accumulator, save: _Figures, groupings, means: _Mean, stats: dict, prefix: str,
                      where: str) -> None:
    """One figure per statistic and grouping of its per-step means (`prefix` + stat + grouping names the file)."""
    for stat, desc in stats.items():
        rows = acc.table_of(means.get, stat)
        for g in groupings if rows else ():
            save(save.plots.plot_metric(rows, g, ylabel=stat), f"{prefix}{stat}_{g}", f"{desc} {where}, grouping '{g}'")


def _attention_figures(acc: _Accumulator, save: _Figures, groupings, result, findings) -> None:
    plots = save.plots
    _per_step_figures(acc, save, groupings, acc.att_mean, ATTENTION_STATS, "",
                      "per realised step, mean over heads and sequences")
    _coarse_to_fine(result, findings, save, plots, acc.step_meta, acc.head_values, acc.keys)
    if acc.att_succ.keys():
        rows = [{"step": t, "stage": "loop", "recurrence": t, "layer": ell, "value": v}
                for ell in acc.att_succ.keys() for t, v in enumerate(acc.att_succ.get(ell).tolist(), start=2)]
        result["attention_distance_successive"] = {str(ell): _tolist(acc.att_succ.get(ell))
                                                   for ell in acc.att_succ.keys()}
        save(plots.plot_metric(rows, "layer", ylabel="‖A_t − A_{t−1}‖_F"), "attention_distance_successive",
             "Frobenius distance between a layer's attention at recurrence t and t − 1 (paper Fig. 25)")
    if acc.att_sim.keys():
        D = acc.att_sim.get("m")
        labels = [f"l{ell}.t{t}" for ell, t in acc.att_sim_labels]
        result["attention_similarity_matrix"] = {"labels": labels, "matrix": _tolist(D)}
        save(plots.plot_matrix(D.tolist(), labels, "attention distance matrix (loop steps)", "‖A − A'‖_F"),
             "attention_similarity_matrix",
             "cyclic similarity matrix of attention over all loop steps; diagonal bands = cyclic convergence")
    if acc.cross_iter:
        _cross_iteration_figure(acc, save, result)


def _cross_iteration_figure(acc: _Accumulator, save: _Figures, result) -> None:
    R = acc.R
    per = torch.stack([m for _, m in acc.cross_iter]).mean(1)  # (n, H, S) → mean over heads: (n, S)
    mean, std = per.mean(0), (per.std(0) if per.shape[0] > 1 else torch.zeros(per.shape[1]))
    per_head = {}
    for ell, m in acc.cross_iter:
        per_head.setdefault(ell, []).append(m)
    result["cross_iteration_mass"] = {
        "query_depth": R, "mean": _tolist(mean), "std": _tolist(std),
        "per_layer_head": {str(ell): _tolist(torch.stack(v).mean(0)) for ell, v in per_head.items()},
    }
    save(save.plots.plot_bars([f"stream {j + 1}" for j in range(len(mean))], mean.tolist(), std.tolist(),
                              f"attention mass per key stream, queries at depth {R}", "mass"),
         "cross_iteration_mass", "TaH2: attention mass of depth-R queries on each key stream (mean ± sd)")


def _residual_figures(acc: _Accumulator, save: _Figures, groupings, result) -> None:
    plots = save.plots
    _per_step_figures(acc, save, groupings, acc.res_mean, RESIDUAL_STATS, "residual_", "after every realised step")
    if acc.succ.keys():
        result["successive_difference"] = {}
        for kind in ("l2", "relative", "cosine"):
            rows = []
            for ell, k in acc.succ.keys():
                if k != kind:
                    continue
                vals = acc.succ.get((ell, kind)).tolist()
                result["successive_difference"].setdefault(str(ell), {})[kind] = vals
                rows += [{"step": t, "stage": "loop", "recurrence": t, "layer": ell, "value": v}
                         for t, v in enumerate(vals, start=2)]
            save(plots.plot_metric(rows, "layer", ylabel=f"successive {kind}"), f"residual_successive_{kind}",
                 f"residual successive {kind} difference X_t vs X_(t−1) per loop layer (paper Figs. 3, 24)")
    if acc.res_sim.keys():
        D = acc.res_sim.get("m")
        result["residual_similarity_matrix"] = {"labels": acc.res_sim_labels, "matrix": _tolist(D)}
        save(plots.plot_matrix(D.tolist(), acc.res_sim_labels, "residual cosine similarity", "cos"),
             "residual_similarity_matrix", "cosine similarity of mean residuals after every realised step "
                                           "(paper Fig. 19)")


def _reports_depth(config) -> bool:
    """Whether the architecture decides a depth per token (the registry's `reports_depth`: TaH2)."""
    spec = ARCHITECTURES.get(getattr(config, "model_type", ""))
    return bool(spec is not None and spec.reports_depth)


def _analyze_into(model, tokenizer, texts, out, recurrences, metrics, t_fp, max_length, progress, name,
                  max_depth_map_texts, groupings) -> dict:
    """Trace every text, then write the figures, metrics.json and report.md into `out`."""
    cfg = model.config
    device = next(model.parameters()).device
    encoded = [ids for ids in (_encode(tokenizer, t) for t in texts) if len(ids) >= 2]
    if not encoded:
        raise ValueError("every input text tokenises to fewer than 2 tokens")
    bos = getattr(tokenizer, "bos_token_id", None)
    if _reports_depth(cfg) and recurrences is None:
        recurrences = cfg.max_iterations  # every token forced to depth M: all steps exist for every sequence
    longest = max(len(ids) for ids in encoded)
    if recurrences is not None:
        check_trace_memory(cfg, "--recurrences", recurrences, min(longest, max_length), "attention" in metrics)
    if "fixed_point" in metrics:
        check_trace_memory(cfg, "--fixed-point-recurrences", t_fp, longest, False)
    acc = _Accumulator(model, metrics, recurrences, max_length)
    for ids in _progress(encoded, progress, "analyze"):
        acc.add(ids, device)

    save, findings = _Figures(out), {}
    result: dict = {"model": {"name": name, "model_type": cfg.model_type, "recurrences": acc.R,
                              "num_hidden_layers": cfg.num_hidden_layers},
                    "inputs": {"sequences": len(encoded), "truncated_to_max_length": acc.truncated,
                               "mean_tokens": sum(min(len(e), max_length) for e in encoded) / len(encoded),
                               "max_length": max_length,
                               "bos_prepended": bool(bos is not None and encoded[0][0] == bos)},
                    "steps": acc.step_rows()}
    if not acc.R or acc.R <= 1:
        groupings = ("none",)  # one pass: the recurrence and layer groupings have nothing to show
    if "attention" in metrics:
        _attention_figures(acc, save, groupings, result, findings)
    if "residual" in metrics:
        _residual_figures(acc, save, groupings, result)
    if "fixed_point" in metrics:
        _fixed_points(model, encoded, t_fp, device, progress, result, findings, save, save.plots,
                      with_attention="attention" in metrics, max_length=max_length)
    if "depth" in metrics and _reports_depth(cfg):
        _tah2_depth(model, tokenizer, encoded, device, progress, result, findings, save, save.plots, out,
                    max_depth_map_texts, save.described)
    result["figures"] = save.described
    result["findings"] = findings
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(result, f, indent=1, default=_tolist)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(_report(result))
    return result


def _coarse_to_fine(result, findings, save, plots, step_meta, head_values, keys):
    """H_km and LAM per loop t, over all heads and over the 40% most dynamic (layer, head) pairs (SpiralFormer's dynamic heads)."""
    loop_keys = [k for k in keys if step_meta[k]["stage"] == "loop"]
    ts = sorted({step_meta[k]["recurrence"] for k in loop_keys})
    layers = sorted({step_meta[k]["layer"] for k in loop_keys})
    if len(ts) < 2:
        return
    panels, summary = {}, {}
    for stat, title in (("key_marginal_entropy", "key-marginal entropy H_km / log L_t"),
                        ("local_attention_mass", "local attention mass")):
        grid = []
        for t in ts:
            row = []
            for ell in layers:
                k = next((k for k in loop_keys if step_meta[k]["recurrence"] == t and step_meta[k]["layer"] == ell),
                         None)
                vals = head_values.get((stat, k))
                if not vals or len({v.shape for v in vals}) > 1:
                    return
                row.append(torch.stack(vals).mean(0))
            if len({r.shape for r in row}) > 1:
                return  # SGT: loops cover different head sets
            grid.append(torch.stack(row))
        try:
            metric = torch.stack(grid)  # (R, L, H)
        except RuntimeError:
            return
        dyn = am.dynamic_heads(metric)
        all_heads = metric.mean((1, 2)).tolist()
        panels[title] = {"all heads": all_heads, "dynamic heads (top 40%)": dyn["curve"].tolist()}
        summary[stat] = {"all_heads": all_heads, "dynamic_heads": dyn["curve"].tolist(),
                         "dynamic_mask": dyn["mask"].int().tolist()}
    resolutions = [next(step_meta[k]["resolution"] for k in loop_keys if step_meta[k]["recurrence"] == t) for t in ts]
    xlabels = [f"t{t}\nr={r:g}" for t, r in zip(ts, resolutions, strict=True)]
    multires = len(set(resolutions)) > 1
    stem = "coarse_to_fine" if multires else "loop_attention_scope"
    save(plots.plot_loop_curves(panels, "coarse-to-fine: attention scope per loop" if multires else
                                "attention scope per loop", xlabels), stem,
         "key-marginal entropy (normalised) and local attention mass per loop t, all heads and the 40% most dynamic "
         "heads (SpiralFormer paper)")
    hkm = summary["key_marginal_entropy"]["dynamic_heads"]
    lam = summary["local_attention_mass"]["dynamic_heads"]
    summary["resolutions"] = resolutions
    result["coarse_to_fine" if multires else "loop_attention_scope"] = summary
    if not multires:
        findings["loop_attention_scope"] = {
            "text": (f"All loops run at one resolution (the coarse-to-fine trend does not apply): dynamic-head H_km "
                     f"{hkm[0]:.3f} → {hkm[-1]:.3f}, LAM {lam[0]:.3f} → {lam[-1]:.3f} from loop 1 to loop {len(hkm)}.")}
        return
    d_h, d_l = _first_last_trend(hkm), _first_last_trend(lam)
    n_tok = result["inputs"]["mean_tokens"]
    windows = ", ".join(f"{am.lam_window(r)}" for r in resolutions)
    if d_h < 0 and d_l > 0:
        verdict = "appears"
    elif d_h < 0 or d_l > 0:
        verdict = "partially appears"
    else:
        verdict = "does not appear"
    findings["coarse_to_fine"] = {
        "verdict": verdict, "hkm_first": hkm[0], "hkm_last": hkm[-1], "lam_first": lam[0], "lam_last": lam[-1],
        "text": (f"Paper trend (coarse→fine loops move from global to local attention: H_km falls, LAM rises) "
                 f"{verdict}: dynamic-head H_km {hkm[0]:.3f} → {hkm[-1]:.3f}, LAM {lam[0]:.3f} → {lam[-1]:.3f} "
                 f"from loop 1 to loop {len(hkm)} (LAM windows {windows} latents; mean sequence {n_tok:.0f} tokens"
                 f"{', so a 32-token window covers much of every input' if n_tok < 128 else ''})."),
    }


def _fixed_points(model, encoded, t_fp, device, progress, result, findings, save, plots, with_attention=False,
                  max_length=512):
    """Run T_fp recurrences (residuals only): distance/cosine to X*, the degenerate-vs-cyclic score and the
    limiting-behaviour classification (fixed point, cycle or drift)."""
    err = recurrence_support_error(model, t_fp)
    if err is not None:
        findings["fixed_point"] = {"verdict": "not measured", "text": f"Fixed points not measured: {err}"}
        return
    dist, cos = _Mean(), _Mean()
    degenerate, separation = [], []
    att_fp = _Mean()
    counts = defaultdict(int)
    periods = []
    layers = None
    for ids in _progress(encoded, progress, f"fixed points (R={t_fp})"):
        record = ("residual", "attention") if with_attention else ("residual",)
        trace = capture_trace(model, torch.tensor([ids], device=device), num_recurrences=t_fp, record=record,
                              max_length=max_length)
        layers = trace.loop_layers
        if with_attention:
            for ell, d in am.attention_fixed_point_distance(trace).items():
                att_fp.add(ell, d)
        try:
            fp = rm.fixed_point_distance_trace(trace)
        except ValueError as err:
            findings["fixed_point"] = {"verdict": "not measured", "text": f"Fixed points not measured: {err}"}
            return
        for ell, d in fp.items():
            dist.add(ell, d["distance"])
            cos.add(ell, d["cosine"])
        score = rm.degenerate_fixed_point_score_trace(trace)
        if not math.isnan(score):
            degenerate.append(score)
            separation.append(rm.fixed_point_separation_trace(trace))
        cls = rm.classify_limiting_behaviour_trace(trace)
        for k, v in cls["counts"].items():
            counts[k] += v
        periods += cls["orbit_periods"]
    total = max(sum(counts.values()), 1)
    fractions = {k: counts[k] / total for k in ("fixed_point", "orbit", "slider", "unknown")}
    score = sum(degenerate) / len(degenerate) if degenerate else float("nan")
    result["fixed_point"] = {
        "recurrences": t_fp, "distance": {str(ell): _tolist(dist.get(ell)) for ell in layers},
        "cosine": {str(ell): _tolist(cos.get(ell)) for ell in layers},
        "degenerate_score": _tolist(score), "limiting_behaviour": {"counts": dict(counts), "fractions": fractions,
                                                                   "orbit_periods": periods[:100]},
    }
    for what, acc, ylabel in (("distance", dist, "‖X_t − X*‖"), ("cosine", cos, "cos(X_t, X*)")):
        rows = [{"step": t, "stage": "loop", "recurrence": t, "layer": ell, "value": v}
                for ell in layers for t, v in enumerate(acc.get(ell).tolist(), start=1)]
        save(plots.plot_metric(rows, "layer", ylabel=ylabel), f"fixed_point_{what}",
             f"{what} of the residual at recurrence t to the approximate fixed point X* = X_(T_fp = {t_fp}) per loop "
             "layer (paper Figs. 4, 22, 23)")
    if att_fp.keys():
        result["fixed_point"]["attention_distance"] = {str(ell): _tolist(att_fp.get(ell)) for ell in att_fp.keys()}
        rows = [{"step": t, "stage": "loop", "recurrence": t, "layer": ell, "value": v}
                for ell in att_fp.keys() for t, v in enumerate(att_fp.get(ell).tolist(), start=1)]
        save(plots.plot_metric(rows, "layer", ylabel="‖A_t − A_T_fp‖_F"), "attention_distance_fixed_point",
             f"Frobenius distance of each loop layer's attention at recurrence t to its attention at T_fp = {t_fp}")
    names = list(fractions)
    save(plots.plot_bars(names, [fractions[n] for n in names], title=f"limiting behaviour of tokens (R = {t_fp})",
                         ylabel="fraction of tokens"), "limiting_behaviour",
         "per-token classification of the last loop layer's trajectory: fixed point / orbit / slider / unknown")
    sep = sum(separation) / len(separation) if separation else float("nan")
    result["fixed_point"]["relative_separation"] = _tolist(sep)
    findings["fixed_point"] = _fixed_point_verdict(t_fp, fractions, score, sep)


def _fixed_point_verdict(t_fp: int, fractions: dict, score: float, sep: float) -> dict:
    """Finding of the fixed-point run: converged (≥ 50% of tokens at a fixed point), then degenerate (score > 0.95)
    or cyclic fixed points."""
    converged = fractions["fixed_point"] >= 0.5
    if not converged:
        verdict, cyclic = "no fixed point", "no (no fixed point)"
    elif math.isnan(score):
        verdict, cyclic = "fixed point (one loop layer: degenerate vs cyclic undecidable)", "undecidable (one layer)"
    elif score > 0.95:
        verdict, cyclic = "degenerate fixed point", "no"
    else:
        verdict, cyclic = "cyclic fixed points", "yes"
    return {
        "verdict": verdict, "cyclic_fixed_points": cyclic, "fixed_point_fraction": fractions["fixed_point"],
        "degenerate_score": _tolist(score), "relative_separation": _tolist(sep),
        "text": (f"After {t_fp} recurrences {fractions['fixed_point']:.1%} of tokens reach a fixed point "
                 f"(orbit {fractions['orbit']:.1%}, slider {fractions['slider']:.1%}); degenerate score "
                 f"min_l cos(X*_1, X*_l) = {score:.3f}, per-layer fixed points differ by "
                 f"max_l ‖X*_1 − X*_l‖/‖X*_1‖ = {sep:.3f} on average → {verdict}; cyclic fixed points: {cyclic}. "
                 f"[thresholds: fixed-point fraction ≥ 50%, degenerate if score > 0.95]"),
    }


def _tah2_depth(model, tokenizer, encoded, device, progress, result, findings, save, plots, out, n_maps, figures):
    from .tah2_depth import (
        decider_gain_alignment,
        decider_gain_records,
        forced_depth_loss_change,
        loss_change_fractions,
    )

    cfg = model.config
    if cfg.max_iterations < 2:
        return
    g1, l1, l2, masks, deltas = [], [], [], [], []
    maps = []
    for n, ids in enumerate(_progress(encoded, progress, "TaH2 depth")):
        x = torch.tensor([ids], device=device)
        if cfg.decider == "learned":
            rec = decider_gain_records(model, x)
            g1.append(rec["g1"].flatten())
            l1.append(rec["loss1"].flatten())
            l2.append(rec["loss2"].flatten())
            masks.append(rec["mask"].flatten())
        deltas.append(forced_depth_loss_change(model, x).flatten())
        if n < n_maps:
            with torch.no_grad():
                o = model(input_ids=x, use_cache=False)
            maps.append((ids, o.iter_counts[0].tolist(), o.continue_probs[0].tolist()))
    if g1:
        rows = decider_gain_alignment(torch.cat(g1), torch.cat(l1), torch.cat(l2), torch.cat(masks))
        result["decider_gain_alignment"] = rows
        save(plots.plot_decider_gain(rows), "decider_gain_alignment",
             "mean loss reduction of a second iteration per continue-probability bin (TaH2 Fig. 6)")
    delta = torch.cat(deltas)
    fr = loss_change_fractions(delta)
    result["forced_depth_loss_change"] = fr
    save(plots.plot_loss_change_histogram(delta.tolist(), fr), "forced_depth_loss_change",
         f"histogram of ℓ(1) − ℓ(M) with every token forced to depth M = {cfg.max_iterations} (TaH2 Fig. 3)")
    findings["forced_depth"] = {"text": f"Forced depth {cfg.max_iterations}: {fr['improved']:.1%} of tokens improve, "
                                        f"{fr['little']:.1%} change little, {fr['worse']:.1%} get worse."}
    try:
        from . import depth_map as dm
    except ImportError:
        return
    try:
        rows = [dm.depth_map([tokenizer.decode([t]) for t in ids], depths, continue_probs=cp, label=f"text {i + 1}")
                for i, (ids, depths, cp) in enumerate(maps)]
        with open(os.path.join(out, "depth_map.html"), "w") as f:
            f.write(dm.render_html(rows, cfg.max_iterations))
        dm.render_png(rows, cfg.max_iterations, os.path.join(out, "depth_map.png"))
        figures["depth_map"] = "per-token depth map of the first texts (HTML with tooltips, PNG)"
    except Exception as err:  # the depth map is optional here; the rest of the analysis stands without it
        findings["depth_map"] = {"text": f"depth map skipped: {type(err).__name__}: {err}"}


def _report(result: dict) -> str:
    m = result["model"]
    lines = [f"# Analysis of {m['name']}", "",
             f"- model type: {m['model_type']}, recurrences analysed: {m['recurrences']}",
             f"- sequences: {result['inputs']['sequences']} (BOS prepended: {result['inputs']['bos_prepended']}; "
             f"truncated to {result['inputs']['max_length']} tokens: {result['inputs']['truncated_to_max_length']})",
             "", "## Findings (as measured)", ""]
    if result["findings"]:
        for key, f in result["findings"].items():
            lines.append(f"- **{key.replace('_', ' ')}**: {f['text']}")
    else:
        lines.append("- no loop-level finding applies to this model")
    lines += ["", "## Figures", "", "Each figure is saved as PNG and SVG; the numbers are in metrics.json.", ""]
    for stem, desc in result["figures"].items():
        ext = "png" if stem != "depth_map" else "html/.png"
        lines.append(f"- `{stem}.{ext}`: {desc}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="model directory (any hf_loops architecture or plain Qwen3)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", action="append", default=None, help="text to analyse (repeatable)")
    src.add_argument("--dataset", default=None, help=".jsonl (question/text/prompt field), .json list or .txt lines "
                                                     "(default: the packaged 100 GSM8K test questions)")
    p.add_argument("--recurrences", type=int, default=None, help="recurrences to run (default: as trained)")
    p.add_argument("--fixed-point-recurrences", type=int, default=T_FP, help="T_fp of the fixed-point pass (128)")
    p.add_argument("--metrics", nargs="+", default=None, choices=list(METRIC_GROUPS), help="metric groups (all)")
    p.add_argument("--grouping", nargs="+", default=None, choices=["none", "recurrence", "layer"],
                   help="plot groupings of the per-step metrics (all three)")
    p.add_argument("--num-samples", type=int, default=None, help="use only the first N texts")
    p.add_argument("--max-length", type=int, default=512, help="token cap for attention capture")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory, or 'bytes' (default: the checkpoint's)")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--debug", action="store_true", help="show the traceback of a failure")


def main(args) -> int:
    """`hf-loops analyze`: bad input raises ValueError (the CLI prints one line and exits 2)."""
    check_output_dir(args.out, "--out", overwrite=args.overwrite, hint=" (pass --overwrite to replace it)")
    check_counts(args.recurrences, args.fixed_point_recurrences, args.max_length)
    if args.text:
        texts = list(args.text)
    else:
        path = args.dataset or default_dataset_path()
        texts = load_texts(path) if path else list(ILLUSTRATIVE_PROMPTS)
    if args.num_samples is not None:
        if args.num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
        texts = texts[: args.num_samples]
    torch.manual_seed(args.seed)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError('hf-loops analyze needs matplotlib: pip install "hf_loops[plot]"') from None
    model, tok = load_model_and_tokenizer(args.checkpoint, args.tokenizer)
    result = analyze(model, tok, texts, args.out, recurrences=args.recurrences, metrics=args.metrics,
                     fixed_point_recurrences=args.fixed_point_recurrences, max_length=args.max_length,
                     overwrite=args.overwrite, progress=not args.no_progress, groupings=args.grouping,
                     name=os.path.basename(os.path.normpath(args.checkpoint)))
    print(f"wrote {len(result['figures'])} figures, metrics.json and report.md to {args.out}")
    for f in result["findings"].values():
        print(f"- {f['text']}")
    return 0


__all__ = ["ILLUSTRATIVE_PROMPTS", "METRIC_GROUPS", "add_arguments", "analyze", "load_model_and_tokenizer",
           "load_texts", "main"]
