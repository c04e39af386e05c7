"""Shared pieces of the TaH2 training sweeps (single process and 2 gloo ranks): scripted deciders, batch layouts, an
independent slow reference of the spec §4 label rule, and one case runner.

The reference works on Python floats and loops over tokens, so it shares no code with `tah2_labels.py`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from hf_loops.training.tah2_trainer import tah2_joint_loss

ARGS = dict(coverage=0.9, decider_loss_weight=0.05, cost_min=1e-6, cost_max=1.0, beta_clamp=(0.02, 50.0),
            bce_margin=0.0, lookahead=True)
DECIDERS = ("learned_stop", "learned_continue", "learned_mixed", "script_stop", "script_continue", "script_mixed",
            "script_only_depth2")
PADDINGS = ("none", "right", "left", "left_with_empty_row", "packed")


class ArgsNS:
    def __init__(self, **kw):
        self.__dict__.update(ARGS)
        self.__dict__.update(kw)


# ----------------------------------------------------------------------------------------------------------------------
# Scripted deciders: decisions that depend only on the token (its embedding) and the depth, so a padded batch and its
# rows run alone take the same routes.
# ----------------------------------------------------------------------------------------------------------------------


class ScriptedDecider:
    """Replaces `model._continue_logit` for one forward at a time; `reset()` before each forward (the main forward
    calls the decider once per depth, in order; the lookahead never does)."""

    def __init__(self, kind: str, seed: int):
        self.kind, self.seed, self.depth = kind, seed, 0

    def reset(self):
        self.depth = 0

    def __call__(self, embeds, hidden, logits):
        self.depth += 1
        if self.kind == "script_stop":
            g = torch.full(embeds.shape[:1], 0.1)
        elif self.kind == "script_continue":
            g = torch.full(embeds.shape[:1], 0.9)
        else:
            key = embeds[:, :4].double().sum(-1) * 1000.0 * (self.depth + 1) + self.seed
            cont = torch.frac(torch.sin(key) * 43758.5453).abs() > 0.5
            if self.kind == "script_only_depth2" and self.depth >= 2:
                cont = torch.zeros_like(cont)
            g = torch.where(cont, 0.9, 0.1)
        return torch.logit(g.float()).to(embeds.device)


def install_decider(model, kind: str, seed: int):
    """Scripted kinds patch the model; learned kinds keep the decider and pick τ so that nobody / everybody / about
    half continue. Returns (extra forward kwargs, the scripted decider or None)."""
    for attr in ("_continue_logit", "forward"):
        model.__dict__.pop(attr, None)
    if kind.startswith("learned"):
        tau = {"learned_stop": 0.999, "learned_continue": 0.001, "learned_mixed": 0.5}[kind]
        return {"exit_threshold": tau}, None
    script = ScriptedDecider(kind, seed)
    model._continue_logit = script
    forward = type(model).forward.__get__(model)

    def reset_then_forward(*a, **kw):
        script.reset()
        return forward(*a, **kw)

    model.forward = reset_then_forward
    return {}, script


# ----------------------------------------------------------------------------------------------------------------------
# Batch layouts
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    inputs: dict  # input_ids, labels, attention_mask / position_ids
    rows: list  # per real row (or packed document): dict of input_ids, labels for the row run alone


def make_batch(rng: random.Random, padding: str, vocab: int = 97) -> Batch:
    B = rng.randint(2, 3)
    lengths = [rng.randint(2, 11) for _ in range(B)]
    rows = []
    for n in lengths:
        ids = [rng.randint(3, vocab - 1) for _ in range(n)]
        labels = list(ids)
        for i in range(rng.randint(0, n // 2)):  # a prompt: no loss on its first tokens
            labels[i] = -100
        rows.append({"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])})
    if padding == "packed":
        ids = torch.cat([r["input_ids"] for r in rows], 1)
        labels = torch.cat([r["labels"].clone() for r in rows], 1)
        pos = torch.cat([torch.arange(r["input_ids"].shape[1]) for r in rows])[None]
        starts = (pos[0] == 0).nonzero().flatten()
        labels[0, starts] = -100  # a document's first token is nobody's target across the boundary
        for r in rows:
            r["labels"] = r["labels"].clone()
            r["labels"][0, 0] = -100
        return Batch({"input_ids": ids, "labels": labels, "position_ids": pos}, rows)
    T = max(lengths)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    labels = torch.full((len(rows), T), -100)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        n = r["input_ids"].shape[1]
        sl = slice(T - n, T) if padding.startswith("left") else slice(0, n)
        ids[b, sl], labels[b, sl], mask[b, sl] = r["input_ids"][0], r["labels"][0], 1
    inputs = {"input_ids": ids, "labels": labels}
    if padding != "none" or rng.random() < 0.5:  # "none" sometimes passes an all-ones mask
        inputs["attention_mask"] = mask
    if padding == "none":
        inputs = {"input_ids": ids[:1], "labels": labels[:1], **({"attention_mask": mask[:1]} if "attention_mask" in inputs else {})}
        rows = rows[:1]
        n = rows[0]["input_ids"].shape[1]
        inputs = {k: v[:, :n] for k, v in inputs.items()}
    if padding == "left_with_empty_row":
        for k, fill in (("input_ids", 0), ("labels", -100), ("attention_mask", 0)):
            inputs[k] = torch.cat([inputs[k], torch.full((1, T), fill, dtype=inputs[k].dtype)], 0)
    return Batch(inputs, rows)


# ----------------------------------------------------------------------------------------------------------------------
# The slow reference of the label rule (spec §4.3–4.4)
# ----------------------------------------------------------------------------------------------------------------------


def reference_labels(executed, token_loss, look_loss, supervised, M, coverage, cost_min, cost_max, beta_clamp):
    """Per boundary: (continue labels, weights, δ_cut, β) as nested lists, from per-token Python loops.

    `executed`, `token_loss`, `look_loss`, `supervised` are lists over "tokens" (flattened, possibly from several
    ranks) of per-depth values, i.e. executed[i][m-1] etc."""
    n_tok = len(supervised)
    prev = [True] * n_tok
    out = []
    for m in range(1, M):
        a = [executed[i][m - 1] if m - 1 < len(executed[i]) else False for i in range(n_tok)]
        delta = [float(token_loss[i][m - 1]) - float(look_loss[i][m - 1]) if a[i] else 0.0 for i in range(n_tok)]
        delta = [float(torch.tensor(d, dtype=torch.float32)) for d in delta]  # the model's gains are fp32
        cands = [i for i in range(n_tok) if supervised[i] and a[i] and prev[i]]
        gains = sorted((delta[i] for i in cands if delta[i] > 0), reverse=True)
        cut = None
        if gains:
            total = 0.0
            for g in gains:
                total += g
            running = 0.0
            for g in gains:  # the first gain at which the running sum covers ρ of the total
                running += g
                if running >= coverage * total:
                    cut = g
                    break
            cut = gains[-1] if cut is None else cut
        c = [False] * n_tok if cut is None else [i in set(cands) and delta[i] >= cut for i in range(n_tok)]
        cut = 0.0 if cut is None else cut
        w = []
        for i in range(n_tok):
            if not (supervised[i] and a[i]):
                w.append(0.0)
            elif prev[i]:
                w.append(min(max(abs(delta[i] - cut), cost_min), cost_max))
            else:
                w.append(cost_min)
        n_stop = sum(1 for i in range(n_tok) if supervised[i] and a[i] and not c[i])
        n_cont = sum(1 for i in range(n_tok) if supervised[i] and a[i] and c[i])
        beta = n_stop / n_cont if n_stop and n_cont else 1.0
        if beta_clamp is not None:
            beta = min(max(beta, beta_clamp[0]), beta_clamp[1])
        out.append((c, w, cut, beta))
        prev = c
    return out


def flatten_records(rec, look, labels_obj=None):
    """Per token of the (B, T) grid: executed, ℓ(m), ℓ(m+1)-lookahead lists, supervised, in row-major order."""
    B, T = rec.targets.shape
    executed, token_loss, look_loss, supervised = [], [], [], []
    for b in range(B):
        for t in range(T):
            executed.append([bool(e[b, t]) for e in rec.executed])
            token_loss.append([-float(lp[b, t]) for lp in rec.token_logprob])
            look_loss.append([-float(lp[b, t]) for lp in look] + [0.0] * len(rec.executed))
            supervised.append(bool(rec.targets[b, t] != -100))
    return executed, token_loss, look_loss, supervised


def check_labels_against_reference(labels_d, reference, B, T):
    for m, (c_ref, w_ref, cut_ref, beta_ref) in enumerate(reference):
        c = labels_d.continue_labels[m].reshape(-1).tolist()
        w = labels_d.weights[m].reshape(-1).tolist()
        assert c == c_ref, f"continue labels differ at boundary {m + 1}"
        assert all(abs(x - y) <= 1e-6 + 1e-5 * abs(y) for x, y in zip(w, w_ref, strict=False)), f"weights differ at {m + 1}"
        assert abs(labels_d.delta_cut[m] - cut_ref) <= 1e-6, (labels_d.delta_cut[m], cut_ref)
        assert abs(labels_d.beta[m] - beta_ref) <= 1e-9, (labels_d.beta[m], beta_ref)


# ----------------------------------------------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------------------------------------------


def run_case(model, inputs, extra, args, backward=True):
    """tah2_joint_loss (+ backward); returns (loss, outputs, metrics, lookahead logprobs)."""
    looks = {}
    core = model.module if hasattr(model, "module") else model
    original = type(core).lookahead_logprobs

    def recording(self, records):
        looks["look"] = original(self, records)
        return looks["look"]

    core.lookahead_logprobs = recording.__get__(core)
    try:
        loss, out, metrics = tah2_joint_loss(model, {**inputs, **extra}, args)
    finally:
        core.__dict__.pop("lookahead_logprobs", None)
    assert torch.isfinite(loss), f"loss is {loss}"
    if backward and loss.requires_grad:
        loss.backward()
        for name, p in core.named_parameters():
            if p.grad is not None:
                assert torch.isfinite(p.grad).all(), f"non-finite gradient in {name}"
    return loss, out, metrics, looks.get("look")
