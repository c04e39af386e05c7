"""TaH2: adaptive looped Qwen3 (docs/tah2.md).

The whole Qwen3 backbone is re-applied up to M times per token:

    h(1)   = F(e)                        e = embed(x), F = all decoder layers + final norm
    h(m+1) = F(U(e, h(m)))               U = updater (Eq. 9), only for tokens whose decider says "continue"
    g(m)   = decider(e, h(m), topk(q(m)))  continue iff g > τ (Eq. 10)
    q      = Σ_m ω(m) q(m)               stopping-weighted mixture (Eq. 4), computed in log space in fp32

Attention across iterations is "duo-causal": every token's depth-m states live in a key/value *stream* m−1; a query
at depth d sees the streams its `iteration_attention` mode allows (see `iteration_visibility`). Deeper streams are
sparse: only tokens that ran that depth have entries, so a token costs as many KV entries as depths it executed.

This file ships as Hub remote code: it imports only torch, transformers and its siblings.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers.utils import can_return_tuple

from .cache_tah2 import CallStreams, StreamView, TaH2Cache, flat_sequence_ids, iteration_visibility
from .configuration_tah2 import TaH2Config
from .generation_tah2 import TaH2GenerationMixin
from .loop_utils import (
    BaseModelOutputWithPast,
    LayerCollector,
    LoopCacheView,
    LoopedContinuousBatchingMixin,
    QuantizedLoopCacheMixin,
    Qwen3DecoderLayer,
    accepts_cache_kwarg,
    additive_mask,
    cache_output,
    check_loop_knobs,
    create_causal_mask,
    explicit_mask_backend,
    flex_cpu_guard,
    is_paged_cache,
    iteration_mask,
    paged_update,
    plain_attention_mask,
    positions_from_mask,
    sequence_ids_from_positions,
)

# ----------------------------------------------------------------------------------------------------------------------
# Updater (Eq. 9) and decider (Eq. 10)
# ----------------------------------------------------------------------------------------------------------------------


class TaH2SwiGLU(nn.Module):
    """SwiGLU MLP d → d_ff → d (Eq. 8), bias-free, Qwen3 naming."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TaH2Updater(nn.Module):
    """x(m+1) = RN_out(B_u(RN_pre(W_u [RN_prev(e); RN_last(h(m))]))) — no residual; RN_out makes it embedding-scaled."""

    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.projection = nn.Linear(2 * d, d, bias=False)
        self.mlp = TaH2SwiGLU(d, config.updater_intermediate_size)
        self.norm_prev = Qwen3RMSNorm(d, eps=1e-6)
        self.norm_last = Qwen3RMSNorm(d, eps=1e-6)
        self.norm_pre_mlp = Qwen3RMSNorm(d, eps=1e-6) if config.updater_norm_pre_mlp else nn.Identity()
        self.norm_out = Qwen3RMSNorm(d, eps=1e-6) if config.updater_norm_out else nn.Identity()

    def forward(self, embeds, hidden):
        x = self.projection(torch.cat([self.norm_prev(embeds), self.norm_last(hidden)], dim=-1))
        return self.norm_out(self.mlp(self.norm_pre_mlp(x)))


class TaH2Decider(nn.Module):
    """g = σ(W_score RN_out(B_d(W_d [RN_first(e); RN_last(h(m)); RN_l(top-k probabilities of q(m))])))."""

    def __init__(self, config):
        super().__init__()
        d, k = config.hidden_size, config.decider_topk
        self.topk = k
        self.input_proj = nn.Linear(2 * d + k, d, bias=False)
        self.mlp = TaH2SwiGLU(d, config.decider_intermediate_size)
        self.norm_first = Qwen3RMSNorm(d, eps=1e-6)
        self.norm_last = Qwen3RMSNorm(d, eps=1e-6)
        self.norm_l = Qwen3RMSNorm(k, eps=1e-6)
        self.norm_out = Qwen3RMSNorm(d, eps=1e-6)
        self.score = nn.Linear(d, 1, bias=False)

    def topk_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """k largest next-token probabilities (descending), zero-padded when the vocabulary is smaller than k."""
        k = min(self.topk, logits.shape[-1])
        top = topk_probs(logits, k)  # exp(topk(z) − logsumexp(z)) in fp32, without (N, V) temporaries
        if k < self.topk:
            top = F.pad(top, (0, self.topk - k))
        return top

    def forward(self, embeds, hidden, logits, top_probs: torch.Tensor | None = None) -> torch.Tensor:
        """Continue logit (fp32), one per token. `top_probs`: the k largest probabilities of `logits`, when the caller
        has them already (the training read-out computes them with log q(m)[y], `target_log_prob_and_topk`)."""
        if top_probs is not None and top_probs.shape[-1] < self.topk:
            top_probs = F.pad(top_probs, (0, self.topk - top_probs.shape[-1]))
        p = (self.topk_probs(logits) if top_probs is None else top_probs).to(hidden.dtype)
        x = self.input_proj(torch.cat([self.norm_first(embeds), self.norm_last(hidden), self.norm_l(p)], dim=-1))
        return self.score(self.norm_out(self.mlp(x))).squeeze(-1).float()


class TaH2ExitGate(nn.Module):
    """Ouro Stage II's exit gate λ = σ(w_exitᵀ sg[h(m)]) (d parameters); returns the continue logit logit(1 − λ)."""

    def __init__(self, config):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, embeds, hidden, logits) -> torch.Tensor:
        return -self.gate(hidden.detach()).squeeze(-1).float()


class HuginnAdapter(nn.Module):
    """Huginn-style core adapter (Eq. 12): u(m+1) = a ⊙ r(m) + v ⊙ W_in z, v = softplus(b_in), a = exp(−v ⊙ exp(b_ret));
    z = prelude output, r(m) = core output. d² + 2d parameters; W_in = I and b_in = b_ret = 0 at initialisation."""

    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.input_proj = nn.Linear(d, d, bias=False)
        self.input_bias = nn.Parameter(torch.zeros(d))
        self.retain_bias = nn.Parameter(torch.zeros(d))

    def forward(self, core_out, prelude_out):
        v = F.softplus(self.input_bias.float())
        a = torch.exp(-v * torch.exp(self.retain_bias.float()))
        return (a * core_out.float() + v * self.input_proj(prelude_out).float()).to(core_out.dtype)


class QExit:
    """Ouro Stage II's inference rule: a token's output is its first depth m whose cumulative exit probability
    1 − Π_{j≤m}(1 − λ(j)) reaches q (`exit_threshold`), or M. Every depth still runs (dense streams); with
    `exit_kv_fill="copy_last"` an exited token's deeper K/V are copies of its exit depth's."""

    def __init__(self, valid: torch.Tensor, q: float):
        self.valid = valid
        self.alive = valid.clone()
        self.survival = torch.ones(valid.shape, dtype=torch.float32, device=valid.device)
        self.q = q

    def emit(self, step: DepthStep) -> torch.Tensor:
        """(N,) bool: the step's tokens whose output is this depth's (they have not exited yet)."""
        return self.alive[step.batch_index, step.time_index]

    def update(self, step: DepthStep) -> None:
        index = (step.batch_index, step.time_index)
        survival = self.survival[index] * step.continue_prob
        self.survival = self.survival.index_put(index, survival)
        self.alive = self.alive.index_put(index, self.alive[index] & (survival > 1.0 - self.q))

    def exited(self) -> torch.Tensor:
        return self.valid & ~self.alive


# ----------------------------------------------------------------------------------------------------------------------
# Packing active tokens: a depth runs only the tokens that continue
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class _Packing:
    """Which tokens one depth runs: per batch row `rows`, the active tokens gathered to the left (stable order) and
    right-padded to the widest row. `order` holds each slot's original time index, `real` whether it is a token.
    Training objectives use the flat variant (`flat_of`): one row of every row's active tokens, no padding slots.

    One-token calls (decoding) take `one_per_row`: every slot is a token (depth 1 runs every row, padding included,
    and the padding rows' outputs are masked afterwards), so listing the tokens needs no host sync."""

    rows: torch.Tensor | None  # batch rows that take part (None: all)
    order: torch.Tensor  # (Bj, Tj)
    real: torch.Tensor  # (Bj, Tj) bool
    identity: bool = False  # depth 1: every position of every row, in place
    one_per_row: bool = False  # Tj = 1 and every slot is listed as a token
    rows_host: list | None = None  # one-token packs: `rows` as a host list (None: every row)
    flat_width: int = 0  # > 0: flat (varlen) layout, one row (1, N) of every row's tokens; `order` = b·T + t, T = this

    @property
    def flat(self) -> bool:
        return self.flat_width > 0

    @classmethod
    def everything(cls, valid: torch.Tensor) -> _Packing:
        B, T = valid.shape
        return cls(None, torch.arange(T, device=valid.device).expand(B, T), valid, identity=True, one_per_row=T == 1)

    @classmethod
    def placeholder(cls, batch_size: int, device, flat_width: int = 0) -> _Packing:
        """One padding slot: lets a rank with no active token still run a depth that other ranks run (sharded
        training needs every rank to call the same modules the same number of times)."""
        zero = torch.zeros(1, 1, dtype=torch.long, device=device)
        rows = None if flat_width else torch.zeros(1, dtype=torch.long, device=device)
        return cls(rows, zero, torch.zeros(1, 1, dtype=torch.bool, device=device), flat_width=flat_width)

    @classmethod
    def flat_of(cls, active: torch.Tensor) -> _Packing | None:
        """Flat (varlen) packing: every row's active tokens in one row (1, N), row-major, no per-row right padding
        (a per-row packing pays for the widest row in every row). Rows are kept apart by the mask, which gives every
        (row, document) its own sequence id (`flat_sequence_ids`)."""
        order = active.reshape(-1).nonzero().squeeze(1)
        if order.numel() == 0:
            return None
        real = torch.ones(1, order.numel(), dtype=torch.bool, device=active.device)
        return cls(None, order[None], real, flat_width=active.shape[1])

    @classmethod
    def of_rows(cls, rows: torch.Tensor, rows_host: list, batch_size: int) -> _Packing | None:
        """One-token calls: the packing of the (sorted) rows `rows` (`rows_host` on the host)."""
        n = len(rows_host)
        if n == 0:
            return None
        slot = torch.zeros(n, 1, dtype=torch.long, device=rows.device)
        every = n == batch_size
        return cls(None if every else rows, slot, torch.ones(n, 1, dtype=torch.bool, device=rows.device),
                   one_per_row=True, rows_host=None if every else rows_host)

    @classmethod
    def of(cls, active: torch.Tensor) -> _Packing | None:
        counts = active.sum(1)
        width = int(counts.max()) if active.numel() else 0
        if width == 0:
            return None
        rows = counts.nonzero().squeeze(1)
        if rows.numel() == active.shape[0]:
            rows = None
        sub = active if rows is None else active.index_select(0, rows)
        order = torch.argsort((~sub).to(torch.int8), dim=1, stable=True)[:, :width]
        return cls(rows, order, torch.gather(sub, 1, order))

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) → (Bj, Tj, ...) for this depth's slots."""
        if self.identity:
            return t
        if self.flat:
            return t.flatten(0, 1).index_select(0, self.order[0]).unsqueeze(0)
        t = t if self.rows is None else t.index_select(0, self.rows)
        index = self.order.view(*self.order.shape, *([1] * (t.dim() - 2))).expand(*self.order.shape, *t.shape[2:])
        return torch.gather(t, 1, index)

    def scatter_rows(self, t: torch.Tensor, batch_size: int, fill) -> torch.Tensor:
        """(Bj, Tj) → (B, Tj): rows that do not take part get `fill`."""
        if self.rows is None:
            return t
        out = torch.full((batch_size,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=t.device)
        return out.index_copy(0, self.rows, t)

    def flat_tokens(self):
        """(batch index, time index, slot selector) of every real token of this depth (every slot when
        `one_per_row`)."""
        Bj = self.order.shape[0]
        if self.one_per_row:
            slot = torch.arange(Bj, device=self.order.device)
            zero = torch.zeros_like(slot)
            return (slot if self.rows is None else self.rows), zero, (slot, zero)
        sel = self.real.nonzero(as_tuple=True)
        if self.flat:
            flat = self.order[sel]
            return flat // self.flat_width, flat % self.flat_width, sel
        rows = torch.arange(Bj, device=self.order.device) if self.rows is None else self.rows
        return rows[sel[0]], self.order[sel], sel


# ----------------------------------------------------------------------------------------------------------------------
# One depth of the loop, and the stopping-weighted mixture (Eq. 4)
# ----------------------------------------------------------------------------------------------------------------------


def needs_logits_for_decisions(config) -> bool:
    """Do the decisions of a depth read its logits z(m) (the learned decider, the top-k embedding updater)?"""
    return config.decider == "learned" or config.updater == "topk_embedding"


def next_input(config, updater, embed_weight: torch.Tensor, embeds, hidden, logits):
    """x(m+1) of the continuing tokens (flat (N, d) tensors), for the configured updater; `embed_weight`: the input
    embedding matrix (rows past the vocabulary, if padded, are never read). The one implementation shared by the HF
    model and the vLLM one."""
    kind = config.updater
    if kind == "learned":
        return updater(embeds, hidden)
    if kind == "identity":
        return embeds
    if kind == "hidden":
        return hidden
    # topk_embedding (TaH v1): probability-weighted mix of the top-k tokens' embeddings
    k = min(config.updater_topk, logits.shape[-1])
    top = logits.float().topk(k, dim=-1)
    weights = torch.softmax(top.values, dim=-1).to(embeds.dtype)
    return torch.einsum("nk,nkd->nd", weights, embed_weight[top.indices])


def continue_logit(config, decider, embeds, hidden, logits) -> torch.Tensor:
    """Decider logit (fp32) per token; ±inf for the fixed `always` / `never` deciders."""
    kind = config.decider
    if kind in ("learned", "exit_gate"):
        return decider(embeds, hidden, logits)
    return torch.full((embeds.shape[0],), float("inf") if kind == "always" else float("-inf"), device=embeds.device)


def continue_decisions(config, g: torch.Tensor, exit_threshold: float) -> torch.Tensor:
    """Which tokens run the next depth, from their continue probabilities g (m < M)."""
    if config.decider == "exit_gate":  # every depth runs; `QExit` picks each token's output depth
        return torch.ones_like(g, dtype=torch.bool)
    if config.decision_mode == "sample":
        return torch.bernoulli(g.detach()).bool()
    return g > exit_threshold


@dataclass
class DepthStep:
    """What one depth m produced for its real tokens (flat (N, ...) tensors, N = tokens that ran depth m)."""

    depth: int
    last: bool  # m = M: every token stops here
    batch_index: torch.Tensor  # (N,)
    time_index: torch.Tensor  # (N,)
    slots: tuple  # the tokens' slots in the packed (Bj, Tj) layout
    hidden: torch.Tensor  # h(m), final-normed
    embeds: torch.Tensor  # e
    logits: torch.Tensor | None  # z(m) of every token (None when neither the loss nor a decision needs them)
    kept: torch.Tensor  # (N,) bool: the token's position is one of `logits_to_keep`
    kept_logits: torch.Tensor | None  # z(m) of the kept tokens, when the full mixture is produced
    continue_logit: torch.Tensor | None  # decider logit (fp32, with gradient); None at m = M
    continue_prob: torch.Tensor  # g(m); 0 at m = M
    cont: torch.Tensor  # (N,) bool: the token runs depth m + 1
    emit: torch.Tensor | None = None  # (N,) bool: the token's output includes this depth (None: every token; Q-exit)
    target_logprob: torch.Tensor | None = None  # (N,) log q(m)[y] (fp32, with gradient) when the call has targets


class StoppingWeightedMixture:
    """q_t = Σ_m ω_t(m) q_t(m), accumulated in fp32 log space while the depths run.

    `stop_prob` (Eq. 4): ω(m) = R(m)(1 − g(m)) for a token that continues and R(m) for one that stops, with
    R(m) = Π_{j<m} g(j); `even`: uniform over the executed depths (the 1/m_t is applied at the end); `final`: the last
    executed depth only. Two read-outs: the full distribution at the kept positions (inference, evaluation) and
    log q_t[y_t] alone (training: no (B, T, V) tensor)."""

    def __init__(self, kind: str, batch_size: int, seq_len: int, num_kept: int, device):
        self.kind = kind
        self.shape = (batch_size, seq_len, num_kept)
        self.device = device
        self.remaining = torch.ones(batch_size, seq_len, dtype=torch.float32, device=device)  # R
        self.log_dist = None  # (B, K, V)
        self.log_target = None  # (B, T)

    def log_weights(self, step: DepthStep) -> torch.Tensor:
        """log ω(m) of the step's tokens; updates R."""
        return self.log_weights_at((step.batch_index, step.time_index), step.continue_prob, step.cont)

    def log_weights_at(self, index, g: torch.Tensor, cont: torch.Tensor) -> torch.Tensor:
        """log ω(m) of the tokens at (batch, time) `index` with continue probabilities g and decisions `cont`;
        updates R (the vLLM model calls this with its flat tokens as one row)."""
        if self.kind != "stop_prob":
            return torch.zeros_like(g)
        r = self.remaining[index]
        log_w = torch.log(torch.where(cont, r * (1.0 - g), r).clamp(min=1e-10))
        self.remaining = self.remaining.index_put(index, torch.where(cont, r * g, r))
        return log_w

    def resume_at(self, index, kept_index, remaining: torch.Tensor, log_dist: torch.Tensor) -> None:
        """Continue the mixture of tokens whose earlier depths ran before (the vLLM model: a decode token deferred to
        the next engine step): their remaining mass R at (batch, time) `index` and their accumulated log ω·q over the
        vocabulary at (batch, kept-slot) `kept_index`, as `remaining` and `log_dist` held them then."""
        self.remaining = self.remaining.index_put(index, remaining.to(self.remaining))
        if self.log_dist is None:
            B, _, K = self.shape
            self.log_dist = torch.full((B, K, log_dist.shape[-1]), float("-inf"), device=self.device)
        self.log_dist = self.log_dist.index_put(kept_index, log_dist.to(self.log_dist))

    def _accumulate(self, buffer, index, term):
        if self.kind == "final":
            return buffer.index_put(index, term)
        return buffer.index_put(index, torch.logaddexp(buffer[index], term))

    def add_distribution(self, index, log_w: torch.Tensor, logits: torch.Tensor) -> None:
        """Add ω · q(m) over the vocabulary at (batch, kept-slot) `index`."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        if self.log_dist is None:
            B, _, K = self.shape
            self.log_dist = torch.full((B, K, logp.shape[-1]), float("-inf"), device=self.device)
        self.log_dist = self._accumulate(self.log_dist, index, log_w[:, None] + logp)

    def add_target(self, index, log_w: torch.Tensor, logp_target: torch.Tensor) -> None:
        """Add ω · q(m)[y] at (batch, time) `index`."""
        if self.log_target is None:
            B, T, _ = self.shape
            self.log_target = torch.full((B, T), float("-inf"), device=self.device)
        self.log_target = self._accumulate(self.log_target, index, log_w + logp_target)

    def _normalise(self, log_q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        return log_q - torch.log(depth.clamp(min=1).float()) if self.kind == "even" else log_q

    def log_probs(self, depth_kept: torch.Tensor) -> torch.Tensor | None:
        """(B, K, V) mixture log-probabilities; padding (never ran) gets a finite zero row so losses stay NaN-free."""
        if self.log_dist is None:
            return None
        logits = self._normalise(self.log_dist, depth_kept[..., None])
        return torch.where(depth_kept[..., None] > 0, logits, torch.zeros((), device=self.device))

    def target_log_probs(self, depth: torch.Tensor) -> torch.Tensor:
        """(B, T) log q_t[y_t]; −inf where the token never ran."""
        return self._normalise(self.log_target, depth)


def _vocab_block_rows(num_rows: int, vocab: int, device: torch.device) -> int:
    """Rows per block of the vocabulary-wide work of `target_log_prob` / `topk_probs` on CPU (~8 MiB of fp32 per block): a block stays
    in cache and below malloc's mmap threshold, where one (N, V) temporary costs more in fresh pages than in
    arithmetic. Other devices take all rows at once."""
    if device.type != "cpu":
        return max(num_rows, 1)
    return max(32, (1 << 21) // max(vocab, 1))


def _row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """(N,) fp32 logsumexp of every row, block by block (see `_vocab_block_rows`)."""
    n, vocab = logits.shape
    step = _vocab_block_rows(n, vocab, logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    for s in range(0, n, step):
        torch.logsumexp(logits[s:s + step].float(), -1, out=lse[s:s + step])
    return lse


def _softmax_scaled_grad(logits, lse, scale, index, src) -> torch.Tensor:
    """−scale · softmax(z) + scatter_add(index, src): the gradient of Σ g·log-probability-type terms, written block by
    block into one buffer of the logits' dtype."""
    n, vocab = logits.shape
    step = _vocab_block_rows(n, vocab, logits.device)
    grad = torch.empty_like(logits)
    in_place = logits.dtype == torch.float32
    for s in range(0, n, step):
        e = slice(s, s + step)
        block = torch.sub(logits[e].float(), lse[e, None], out=grad[e] if in_place else None)
        block.exp_().mul_(-scale[e, None]).scatter_add_(-1, index[e], src[e])
        if not in_place:
            grad[e].copy_(block)
    return grad


class _TargetLogProb(torch.autograd.Function):
    """log softmax(z)[y] = z_y − logsumexp(z) in fp32. Saves z and the per-row logsumexp; the backward writes
    −g · softmax(z) + g · onehot(y) straight into one gradient buffer, block by block (autograd's own graph of
    gather + logsumexp allocates and sweeps several (N, V) temporaries)."""

    @staticmethod
    def forward(ctx, logits, targets):
        lse = _row_logsumexp(logits)
        ctx.save_for_backward(logits, targets, lse)
        return logits.gather(-1, targets[:, None]).squeeze(-1).float() - lse

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, lse = ctx.saved_tensors
        g = grad_out.float()
        return _softmax_scaled_grad(logits, lse, g, targets[:, None], g[:, None]), None


class _TopKProbs(torch.autograd.Function):
    """The k largest softmax probabilities exp(z_top − logsumexp(z)) (fp32), with one fused backward:
    ∂/∂z of Σ_k g_k p_k = scatter(top, g·p) − softmax(z) · Σ_k g_k p_k."""

    @staticmethod
    def forward(ctx, logits, k):
        lse = _row_logsumexp(logits)
        values, index = logits.topk(k, dim=-1)
        probs = torch.exp(values.float() - lse[:, None])
        ctx.save_for_backward(logits, index, probs, lse)
        return probs

    @staticmethod
    def backward(ctx, grad_out):
        logits, index, probs, lse = ctx.saved_tensors
        weighted = grad_out.float() * probs
        return _softmax_scaled_grad(logits, lse, weighted.sum(-1), index, weighted), None


class _TargetLogProbAndTopK(torch.autograd.Function):
    """`_TargetLogProb` and `_TopKProbs` of the same logits in one: one logsumexp sweep, and one backward buffer
    −(g_y + Σ_k g_k p_k) · softmax(z) + onehot(y)·g_y + scatter(top, g·p) instead of two summed by autograd."""

    @staticmethod
    def forward(ctx, logits, targets, k):
        lse = _row_logsumexp(logits)
        values, index = logits.topk(k, dim=-1)
        probs = torch.exp(values.float() - lse[:, None])
        ctx.save_for_backward(logits, targets, index, probs, lse)
        return logits.gather(-1, targets[:, None]).squeeze(-1).float() - lse, probs

    @staticmethod
    def backward(ctx, grad_target, grad_probs):
        logits, targets, index, probs, lse = ctx.saved_tensors
        g_target, weighted = grad_target.float(), grad_probs.float() * probs
        scale = g_target + weighted.sum(-1)
        return _softmax_scaled_grad(logits, lse, scale, torch.cat([targets[:, None], index], 1),
                                    torch.cat([g_target[:, None], weighted], 1)), None, None


def target_log_prob_and_topk(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`target_log_prob(logits, targets)`, `topk_probs(logits, k)`) from one pass over the logits, gradients
    included: the decider's read-out and the mixture's log q(m)[y] of a training depth."""
    return _TargetLogProbAndTopK.apply(logits, targets, k)


def topk_probs(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(N, k) fp32: the k largest next-token probabilities of each row, descending (k ≤ V); equal to
    `exp(z.float().topk(k).values − logsumexp(z.float()))`, gradient included, without (N, V) temporaries."""
    return _TopKProbs.apply(logits, k)


def target_log_prob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(z)[y] in fp32, without materialising the log-softmax (equal to
    `z.float().gather(-1, y) − logsumexp(z.float())`, gradient included)."""
    return _TargetLogProb.apply(logits, targets)


def head_target_log_prob(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`target_log_prob(head(hidden), targets)` for gradient-free passes (the lookahead), the head applied to blocks of
    512 rows on CPU (enough rows for an efficient matmul) so that no (N, V) logits tensor is materialised."""
    n = hidden.shape[0]
    step = n if hidden.device.type != "cpu" else 512
    if step >= n:
        return target_log_prob(head(hidden), targets)
    return torch.cat([target_log_prob(head(hidden[s:s + step]), targets[s:s + step]) for s in range(0, n, step)])


# ----------------------------------------------------------------------------------------------------------------------
# Weight gradients of the shared linear layers: one sum per weight, accumulated inside the products
# ----------------------------------------------------------------------------------------------------------------------

# The autograd engine's own answers to "which backward pass is this" and "will this node run in it"; without them
# (another torch) every call returns its own weight gradient, which autograd sums in place.
_ENGINE_QUERIES = hasattr(torch._C, "_current_graph_task_id") and hasattr(torch._C, "_will_engine_execute_node")


class _WeightGradSum:
    """One weight's gradient over the calls of one forward: the later calls (deeper depths) add their products
    into `buffer` with `addmm_` while the first call (the owner) is still to run in the same backward pass; the
    owner adds its own and returns the total."""

    __slots__ = ("owner", "buffer", "task", "owner_done")

    def __init__(self):
        self.owner = None  # weak reference to the first call's backward node
        self.buffer = None
        self.task = None  # the backward pass `buffer` belongs to
        self.owner_done = None  # the last backward pass in which the owner returned


class _LinearSharedWeight(torch.autograd.Function):
    """`F.linear(x, weight)` (no bias) whose weight gradient g^T x is summed over the calls of one forward inside the
    products.

    Every depth runs the same backbone and LM head, so each of their weights receives one gradient per depth.
    Autograd sums them in the weight's input buffer, in place only when the first to arrive is a tensor nothing
    else holds; `nn.Linear`'s backward hands over a transposed view of its product, so every extra depth used to cost
    a weight-sized allocation and an out-of-place add (at the bench's 100m size about 0.2 s of a 3.8 s SFT step, the
    LM head's 131 MB on fresh pages each time). Here a later call that runs before its weight's first call in the
    same backward pass, while that call is still to run (the engine says so), adds its product into one buffer with
    `addmm_` and returns nothing; the first call returns buffer + its product. Every other call returns its own
    product, a plain tensor that autograd adds to in place. So each product is counted exactly once in every
    backward pass, whatever the order, whichever calls run (`torch.autograd.grad` on part of the graph, a retained
    graph run twice). Depth 1 feeds the deeper depths, so in a training step its call runs last and every deeper
    product goes into the buffer. Same sums up to float rounding."""

    @staticmethod
    def forward(ctx, x, weight, total, owner):  # not the `setup_context` form: its `apply` binds a signature per call
        ctx.save_for_backward(x, weight)
        ctx.total, ctx.owner = total, owner
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            g, a = grad.reshape(-1, grad.shape[-1]).t(), x.reshape(-1, x.shape[-1])
            total = ctx.total
            if total is None:  # no engine queries: return the own product
                return grad_x, torch.mm(g, a), None, None
            task = torch._C._current_graph_task_id()
            if total.buffer is not None and total.task != task:  # left by a pass that failed before its owner ran
                total.buffer = None
            owner = total.owner() if total.owner is not None else None
            if ctx.owner:
                grad_w = torch.mm(g, a) if total.buffer is None else total.buffer.addmm_(g, a)
                total.buffer, total.owner_done = None, task
            elif (total.owner_done != task and owner is not None
                  and torch._C._will_engine_execute_node(owner)):
                total.buffer = torch.mm(g, a) if total.buffer is None else total.buffer.addmm_(g, a)
                total.task = task
            else:
                grad_w = torch.mm(g, a)
        return grad_x, grad_w, None, None


class _SharedWeightLinears:
    """While active, the plain bias-free `nn.Linear` layers among `modules` whose weight is trained compute through
    `_LinearSharedWeight` whenever gradients are recorded (the instance's `forward` is shadowed and restored on exit;
    module hooks still run). Layers of another type (LoRA, quantised, sharded / DTensor weights) and frozen weights
    keep their own forward. Only for a pass whose backward runs without recomputing the layers: not under activation
    checkpointing, whose recompute would run the plain layers."""

    def __init__(self, modules, enabled: bool = True):
        self.layers = []
        if enabled:
            self.layers = [m for m in modules if type(m) is nn.Linear and m.bias is None
                           and type(m.weight) is nn.Parameter and m.weight.requires_grad and "forward" not in m.__dict__]
        self.totals: dict = {}

    def _call(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.linear(x, module.weight)
        if not _ENGINE_QUERIES:
            return _LinearSharedWeight.apply(x, module.weight, None, True)
        total = self.totals.get(module)
        owner = total is None
        if owner:
            total = self.totals[module] = _WeightGradSum()
        out = _LinearSharedWeight.apply(x, module.weight, total, owner)
        if owner:
            total.owner = weakref.ref(out.grad_fn)
        return out

    def __enter__(self):
        for m in self.layers:
            m.forward = functools.partial(self._call, m)
        return self

    def __exit__(self, *exc):
        for m in self.layers:
            m.__dict__.pop("forward", None)
        return False


# ----------------------------------------------------------------------------------------------------------------------
# Loop records: what lookahead depth supervision needs from the main forward
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class TaH2LoopRecords:
    """Per-depth quantities of one teacher-forced forward, for lookahead depth supervision.

    Lists are indexed by depth m−1. `token_logprob[m−1]` = log q(m)[y_t] (fp32, detached, 0 where not executed);
    `decider_logits[m−1]` (m < M) keep their gradient; `hidden` are the detached h(m) the lookahead starts from.
    """

    executed: list
    token_logprob: list
    decider_logits: list
    hidden: list
    embeds: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor | None
    streams: CallStreams
    max_iterations: int
    synchronised: bool = False  # depth passes were agreed over data-parallel ranks (the lookahead does the same)


class _LoopRecorder:
    """Collects `TaH2LoopRecords` lists depth by depth, scattered back to (B, T)."""

    def __init__(self, embeds: torch.Tensor):
        self.embeds = embeds
        self.lists = {"executed": [], "token_logprob": [], "decider_logits": [], "hidden": []}

    def add(self, step: DepthStep, logp_target: torch.Tensor) -> None:
        B, T, _ = self.embeds.shape
        device = self.embeds.device
        index = (step.batch_index, step.time_index)
        self.lists["executed"].append(
            torch.zeros(B, T, dtype=torch.bool, device=device).index_put(index, torch.ones_like(index[0], dtype=torch.bool)))
        self.lists["token_logprob"].append(torch.zeros(B, T, device=device).index_put(index, logp_target.detach()))
        self.lists["hidden"].append(torch.zeros_like(self.embeds).index_put(index, step.hidden.detach()))
        if step.continue_logit is not None:
            self.lists["decider_logits"].append(torch.zeros(B, T, device=device).index_put(index, step.continue_logit))

    def records(self, **fields) -> TaH2LoopRecords:
        return TaH2LoopRecords(embeds=self.embeds.detach(), **fields, **self.lists)


class _DepthTrace:
    """Per-token outputs of the loop: executed (or, under Q-exit, output) depth, continue probabilities, per-depth
    hidden states, and the rows the backbone computed at each depth. Every per-depth buffer grows with the depths
    actually run, never with `max_iterations` (which may be far larger than the depth any token reaches)."""

    def __init__(self, run: _LoopSetup, want_hidden: bool):
        B, T, _ = run.embeds.shape
        device = run.embeds.device
        self.run, self.want_hidden = run, want_hidden
        self.iter_counts = torch.zeros(B, T, dtype=torch.long, device=device)
        self.continue_probs = torch.full((B, T, 0), float("nan"), device=device)  # one column per decision depth
        self.iteration_hidden: list = []
        self.rows_per_depth: list = []
        self.first_pass = None

    def add_full_pass(self, h: torch.Tensor) -> None:
        """M = 1: the one pass, every position."""
        self.first_pass = h
        self.rows_per_depth.append(int(h.shape[0] * h.shape[1]))
        self.iter_counts = self.run.valid.long()
        self.iteration_hidden.append(h)

    def add(self, step: DepthStep, h: torch.Tensor) -> None:
        self.first_pass = h if step.depth == 1 else self.first_pass
        self.rows_per_depth.append(int(h.shape[0] * h.shape[1]))
        index = (step.batch_index, step.time_index)
        shown = index if step.emit is None else (index[0][step.emit], index[1][step.emit])
        self.iter_counts = self.iter_counts.index_put(shown, torch.full_like(shown[0], step.depth))
        if self.want_hidden:
            self.iteration_hidden.append(torch.zeros_like(self.run.embeds).index_put(index, step.hidden))
        if not step.last:
            if self.continue_probs.shape[-1] < step.depth:
                self.continue_probs = F.pad(self.continue_probs, (0, step.depth - self.continue_probs.shape[-1]),
                                            value=float("nan"))
            self.continue_probs = self.continue_probs.index_put(
                index + (torch.full_like(index[0], step.depth - 1),), step.continue_prob.detach())


def _any_on_any_rank(flag: bool, synchronise: bool) -> bool:
    """`flag` OR-ed over data-parallel ranks (only while training under torch.distributed)."""
    if not synchronise:
        return flag
    on_gpu = torch.distributed.get_backend() == "nccl"
    t = torch.tensor([1.0 if flag else 0.0], device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else None)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


def shift_targets(labels: torch.Tensor, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Target of every position (HF convention: labels are unshifted; the last position has none)."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def keep_positions(logits_to_keep, seq_len: int, device) -> torch.Tensor:
    """Positions whose logits the call returns (`logits_to_keep`: 0 = all, n = the last n, or explicit positions)."""
    if isinstance(logits_to_keep, int):
        start = 0 if logits_to_keep == 0 else max(seq_len - logits_to_keep, 0)
        return torch.arange(start, seq_len, device=device)
    if torch.is_tensor(logits_to_keep) and logits_to_keep.dim() == 1:
        return logits_to_keep.to(device)
    raise ValueError("logits_to_keep must be an int or a 1-D tensor of positions")


@dataclass
class _LoopSetup:
    """Everything one forward call fixes before its first depth."""

    max_iterations: int
    exit_threshold: float
    embeds: torch.Tensor  # (B, T, d)
    valid: torch.Tensor  # (B, T) bool: real tokens
    attention_mask: torch.Tensor | None  # 2-D padding mask (B, past + T)
    position_ids: torch.Tensor  # (B, T) RoPE positions, the same at every depth
    seq_ids: torch.Tensor | None  # packed (padding-free) rows: document of every token
    token_index: torch.Tensor  # (B, T) stream-0 coordinate (past + t)
    cache: TaH2Cache | None
    past: int
    streams: CallStreams
    targets: torch.Tensor | None  # (B, T) shifted labels, -100 where unsupervised (padding included)
    keep: torch.Tensor  # kept positions
    kept_slot: torch.Tensor  # (T,) slot of each position among the kept ones, -1 if not kept
    all_kept: bool  # every position is kept (known without looking at the device)
    full_logits: bool  # produce the (B, K, V) mixture
    synchronise: bool  # agree on the number of depth passes over data-parallel ranks
    use_cache: bool  # return the cache



# ----------------------------------------------------------------------------------------------------------------------
# Continuous batching: the KV streams in transformers' paged cache
# ----------------------------------------------------------------------------------------------------------------------


class _PagedStreams:
    """TaH2's KV streams in transformers' `PagedAttentionCache` (continuous batching), for one forward call.

    Paged slot `stream * L + layer` holds stream `stream` of layer `layer` for every token of the batch (the paged
    cache is dense: one entry per token per slot). Persisted streams: stream 0 only in "causal" mode (earlier tokens'
    deeper states are never visible: a deeper query sees stream 0 and its own deeper states of this call), every
    stream otherwise. An adaptive model (a token may stop before depth M) with deeper streams persisted also keeps a
    metadata slot (`stream = P`, layer 0): each token's executed depth, written into the key rows, so a token that
    stopped at depth m exposes none of its (never computed) stream >= m entries — the visibility `generate` applies.

    Every depth runs every token of the batch (the paged cache writes each slot for the whole batch); the outputs of
    a token that stopped are discarded and its deeper entries masked, so the tokens that run get what our `forward`
    and `generate` compute."""

    def __init__(self, cache, paged_kwargs: dict, config, base_mask: torch.Tensor, dtype: torch.dtype):
        self.cache = cache
        self.kwargs = paged_kwargs
        self.L = config.num_hidden_layers
        self.mode = config.iteration_attention
        self.num_kv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.base = base_mask if base_mask.dtype != torch.bool else additive_mask(base_mask, dtype)
        self.neg = torch.finfo(self.base.dtype).min
        self.reads: dict[tuple[int, int], tuple] = {}  # (stream, layer) -> (keys, values) read back this call
        self.own: dict[tuple[int, int], tuple] = {}  # causal mode: (stream, layer) -> this call's new deeper K/V
        self.key_depth: torch.Tensor | None = None  # (K,) executed depth of every key (metadata slot read-back)

    @staticmethod
    def num_slots(config) -> int:
        persisted = 1 if config.iteration_attention == "causal" else config.max_iterations
        adaptive_deeper = persisted > 1 and config.decider not in ("always", "never")
        return persisted * config.num_hidden_layers + (1 if adaptive_deeper else 0)

    def write_depths(self, depth: torch.Tensor, config) -> None:
        """Metadata slot: the depth each token of the batch has executed so far (its final depth once it stops)."""
        if _PagedStreams.num_slots(config) % self.L == 0:
            return
        rows = depth.to(self.base.dtype).view(1, 1, -1, 1).expand(1, self.num_kv, depth.numel(), self.head_dim)
        keys, _ = paged_update(self.cache, rows, rows, self.num_slots(config) - 1, self.kwargs)
        self.key_depth = keys[0, 0, :, 0]

    def mask(self, stream: int) -> torch.Tensor:
        """The additive (1, 1, Q, keys) mask of depth `stream + 1`, in the key order `update` returns."""
        if self.mode == "causal":
            if stream == 0:
                return self.base
            q = self.base.shape[-2]
            own = additive_mask(torch.eye(q, dtype=torch.bool, device=self.base.device), self.base.dtype)
            return torch.cat([self.base] + [own[None, None]] * stream, dim=-1)
        streams = [stream] if self.mode == "same_iter" else list(range(stream + 1))
        parts = []
        for j in streams:
            if j == 0 or self.key_depth is None:
                parts.append(self.base)
            else:
                parts.append(torch.where(self.key_depth > j, self.base, torch.full_like(self.base, self.neg)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def update(self, stream: int, key_states, value_states, layer_idx: int):
        if self.mode == "causal" and stream > 0:
            self.own[(stream, layer_idx)] = (key_states, value_states)
            parts = [self.reads[(0, layer_idx)]] + [self.own[(j, layer_idx)] for j in range(1, stream + 1)]
        else:
            self.reads[(stream, layer_idx)] = paged_update(self.cache, key_states, value_states,
                                                           stream * self.L + layer_idx, self.kwargs)
            if self.mode == "duo":
                parts = [self.reads[(j, layer_idx)] for j in range(stream + 1)]
            else:
                return self.reads[(stream, layer_idx)]
        return torch.cat([k for k, _ in parts], dim=-2), torch.cat([v for _, v in parts], dim=-2)


class _PagedDepthView:
    """`cache=` object of the shared layers while they run one depth under continuous batching."""

    def __init__(self, streams: _PagedStreams, stream: int):
        self.streams = streams
        self.stream = stream

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.streams.update(self.stream, key_states, value_states, layer_idx)


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------


@cache_output
@dataclass
class TaH2CausalLMOutput(ModelOutput):
    """Output of `TaH2ForCausalLM`.

    logits: log-probabilities of the stopping-weighted mixture at the kept positions (fp32); with
        `max_iterations == 1` the raw Qwen3 logits (same distribution, bit-exact with Qwen3).
    iter_counts: (B, T) executed depth m_t of every token (0 for padding).
    continue_probs: (B, T, K) decider continue probability g after each depth, NaN where not executed; K = min(M − 1,
        deepest executed depth): one column per depth after which some token's decider ran.
    hidden_states: with `output_hidden_states=True`, the depth-1 pass per layer, as Qwen3 returns them (embeddings,
        outputs of layers 1..L−1, final-normed output).
    attentions: with `output_attentions=True` (eager attention), the depth-1 pass's weights per layer.
    iteration_hidden_states: per depth, (B, T, d) final-normed hidden states h(m) (zeros where not executed); only
        with `output_hidden_states=True`.
    rows_per_depth: number of token rows the backbone computed at each depth (packing: equals the active tokens).
    loop_records: per-depth training quantities (`return_loop_records=True`).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    iter_counts: torch.Tensor | None = None
    continue_probs: torch.Tensor | None = None
    iteration_hidden_states: tuple[torch.Tensor, ...] | None = None
    rows_per_depth: tuple[int, ...] | None = None
    loop_records: TaH2LoopRecords | None = None


class TaH2PreTrainedModel(PreTrainedModel):
    config: TaH2Config
    config_class = TaH2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen3DecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True  # stream 0 (plain causal) only; deeper depths' explicit masks run under sdpa
    _supports_flex_attn = True  # deeper depths get a BlockMask of the visibility pattern (`iteration_mask`)
    _supports_attention_backend = False

    def _init_weights(self, module):
        super()._init_weights(module)
        role = getattr(module, "_tah2_init", None)
        if role == "torch_default":  # the official updater/decider keep nn.Linear's Kaiming-uniform init
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        elif role == "score":  # g ≈ 0.5 at the start of training
            init.normal_(module.weight, mean=0.0, std=0.01)
        if isinstance(module, HuginnAdapter):  # u(2) = r(1)/2 + softplus(0)·z: identity W_in, zero biases [D]
            init.eye_(module.input_proj.weight)
            init.zeros_(module.input_bias)
            init.zeros_(module.retain_bias)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None, every_n_layers=1):
        """Loop-aware checkpointing: HF's per-layer checkpointing drops `cache=`, which would remove the
        cross-iteration keys; instead the model checkpoints each layer call itself with the stream view kept."""
        if gradient_checkpointing_func is None:
            gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        for module in self.modules():
            if isinstance(module, TaH2Model):
                module.gradient_checkpointing = enable
                module._gradient_checkpointing_func = gradient_checkpointing_func
            elif isinstance(module, Qwen3DecoderLayer):
                module.gradient_checkpointing = False


class TaH2Model(TaH2PreTrainedModel):
    """The shared backbone F (embeddings, all Qwen3 decoder layers, final norm) — Qwen3Model's names and weights.

    Called on its own (e.g. via `AutoModel`) it runs one pass, exactly like `Qwen3Model`; the iteration loop needs the
    LM head (the decider reads next-token probabilities) and lives in `TaH2ForCausalLM`. As the backbone of a looped
    `TaH2ForCausalLM` it refuses a direct call unless given `max_iterations=1` (see `_refuse_outside_the_loop`).
    """

    def __init__(self, config: TaH2Config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.is_loop_backbone = False  # set by TaH2ForCausalLM: its forward, not this one, runs the loop
        self.post_init()

    def _refuse_outside_the_loop(self, max_iterations) -> None:
        """The backbone of a looped `TaH2ForCausalLM` runs only inside its loop. Called on its own it gives depth 1,
        which is what TRL's fused LM head (SFT, DPO, GRPO, RLOO, KTO trainers: `model.base_model` then `lm_head`)
        would train or score in place of the mixture, with the updater and decider never trained. Refuse that;
        `max_iterations=1` asks for the one pass on purpose."""
        owner_loops = self.is_loop_backbone and (self.config.max_iterations > 1 or self.config.loop_span is not None)
        if max_iterations not in (None, 1):
            raise ValueError(f"TaH2Model runs one backbone pass: max_iterations must be 1 or omitted, got "
                             f"{max_iterations!r} (the depth loop is TaH2ForCausalLM's)")
        if owner_loops and max_iterations is None:
            raise ValueError(
                f"TaH2Model.forward is one backbone pass, not TaH2's depth loop (max_iterations="
                f"{self.config.max_iterations}): a trainer that calls the backbone and the LM head itself, as TRL's "
                "fused LM head does in SFTTrainer/DPOTrainer/GRPOTrainer, would train a depth-1 model and never the "
                "updater or decider; train with hf_loops.training.TaH2SFTTrainer (or call TaH2ForCausalLM, whose loss "
                "is the mixture's), or pass max_iterations=1 to run the one backbone pass on purpose"
            )

    def run_layers(self, hidden, attention_mask, position_ids, position_embeddings, cache, collect=None, span=None):
        """One pass of the decoder layers (no final norm) with `cache` as the layers' cache object: all of them, or
        the `span` = (start, end) slice (Huginn-style prelude / core / coda).

        `collect` (optional `LayerCollector`) records each layer's input and, under eager attention, its weights."""
        with flex_cpu_guard(self.config, hidden.device), explicit_mask_backend(self.config, attention_mask):
            return self._run_layers(hidden, attention_mask, position_ids, position_embeddings, cache, collect, span)

    def _run_layers(self, hidden, attention_mask, position_ids, position_embeddings, cache, collect, span):
        checkpoint = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers if span is None else self.layers[span[0]:span[1]]:
            if collect is not None:
                collect.hidden.append(hidden)
            call = functools.partial(
                layer.__call__,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                position_embeddings=position_embeddings,
            )
            if collect is not None and collect.attentions is not None:
                with collect.attention_weights_of(layer):
                    hidden = call(hidden)
            elif checkpoint and isinstance(cache, StreamView):  # cross-depth K/V in and out of the checkpoint
                hidden = cache.checkpointed(self._gradient_checkpointing_func, call, hidden, layer.self_attn.layer_idx)
            else:
                hidden = self._gradient_checkpointing_func(call, hidden) if checkpoint else call(hidden)
        return hidden

    @can_return_tuple
    @accepts_cache_kwarg
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        output_hidden_states=None,
        output_attentions=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        self._refuse_outside_the_loop(kwargs.pop("max_iterations", None))
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        attention_mask = plain_attention_mask(attention_mask)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, past, inputs_embeds.shape[1], inputs_embeds.device)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        pos_emb = self.rotary_emb(inputs_embeds, position_ids)
        collect = LayerCollector.requested(self.config, output_hidden_states, output_attentions)
        hidden = self.norm(self.run_layers(inputs_embeds, mask, position_ids, pos_emb, cache if use_cache else None,
                                           collect))
        return BaseModelOutputWithPast(
            last_hidden_state=hidden,
            cache=cache if use_cache else None,
            hidden_states=collect.hidden_states(hidden) if collect is not None and collect.want_hidden else None,
            attentions=tuple(collect.attentions) if collect is not None and collect.attentions is not None else None,
        )


class TaH2ForCausalLM(QuantizedLoopCacheMixin, LoopedContinuousBatchingMixin, TaH2PreTrainedModel,
                      TaH2GenerationMixin):  # continuous depth
    # Layout of the deeper depths of a training objective: "auto" = flat (varlen, `_Packing.flat_of`) where it costs
    # fewer FLOPs than per-row padding (`_flat_is_cheaper`), "flat", or "per_row". The same values up to float rounding
    # (tests compare the two).
    deeper_packing = "auto"
    # Sum the per-depth gradients of the shared weights inside the products (`_LinearSharedWeight`); False:
    # nn.Linear's own backward. The same values up to float rounding (tests compare the two).
    weight_grads_in_place = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Tensor / pipeline parallelism as Qwen3ForCausalLM: the backbone's plan comes from the config (Qwen3's
    # `base_model_tp_plan`), the LM head is column-sharded with gathered logits; the loop's own modules are replicated.
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: TaH2Config):
        super().__init__(config)
        self.model = TaH2Model(config)
        self.model.is_loop_backbone = True
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.updater = TaH2Updater(config) if config.updater == "learned" else None
        deciders = {"learned": TaH2Decider, "exit_gate": TaH2ExitGate}
        self.decider = deciders[config.decider](config) if config.decider in deciders else None
        self.core_adapter = HuginnAdapter(config) if config.core_adapter == "huginn" else None
        for part in (self.updater, self.decider if config.decider == "learned" else None):
            if part is not None:
                for sub in part.modules():
                    if isinstance(sub, nn.Linear):
                        sub._tah2_init = "torch_default"
        if config.decider == "learned":
            self.decider.score._tah2_init = "score"
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, allow_pickle: bool = False, **kwargs):
        """Also loads a local directory in the authors' layout (`tah_config.json` + `iter_decider.bin` +
        `input_updater.bin` next to a plain Qwen3 checkpoint; docs/conversion.md). `allow_pickle=True` lets the two `.bin`
        files fall back to full pickle when `torch.load(weights_only=True)` refuses them."""
        from .tah2_official import is_official_tah2_dir, load_official_tah2

        if not model_args and is_official_tah2_dir(pretrained_model_name_or_path):
            return load_official_tah2(cls.config_class, super().from_pretrained, pretrained_model_name_or_path,
                                      allow_pickle=allow_pickle, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    # -- continuous batching (transformers' paged cache) ---------------------------------------------------------------
    @classmethod
    def continuous_batching_refusal(cls, config) -> str | None:
        """Why transformers' continuous batching cannot run this configuration (None: it can, see `_forward_paged`)."""
        cfg = config
        if cfg.loop_span is not None:
            return ("the Huginn-style core loop (loop_span) is not mapped onto paged cache slots; serve it without "
                    "continuous batching")
        if cfg.decider == "exit_gate":
            return ("the Ouro exit gate's Q-exit and copied exit K/V are not mapped onto paged cache slots; serve it "
                    "without continuous batching")
        if cfg.decision_mode == "sample":
            return ("decision_mode='sample' draws the continue decisions per token, which a batch of interleaved "
                    "requests cannot reproduce; use decision_mode='threshold'")
        return None

    def paged_cache_layer_types(self) -> list[str]:
        return ["full_attention"] * _PagedStreams.num_slots(self.config)

    def _forward_paged(self, input_ids, position_ids, cache, attention_mask, inputs_embeds, logits_to_keep,
                       paged_kwargs) -> TaH2CausalLMOutput:
        """One continuous-batching step (`generate_batch`, `transformers serve --continuous-batching`): the batch's
        tokens laid end to end in one row (1, Q), transformers' block-diagonal causal mask, `cache` its
        `PagedAttentionCache`. Each depth m runs the whole backbone for every token at stream m − 1 (see
        `_PagedStreams`); the depth steps, decisions and mixture are `forward`'s own (`_depth_step`, `_accumulate`)."""
        cfg = self.config
        reason = self.continuous_batching_refusal(self.config)
        if reason is not None:
            raise ValueError(f"TaH2ForCausalLM cannot run under transformers' continuous batching: {reason}")
        mask = plain_attention_mask(attention_mask)
        if not torch.is_tensor(mask) or mask.dim() != 4:
            raise ValueError("TaH2 under continuous batching needs the batch's explicit attention mask: load the model "
                             "with attn_implementation='sdpa' or 'eager'")
        M, tau = self._loop_knobs(None, None)
        embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        _, Q, _ = embeds.shape
        device = embeds.device
        valid = torch.ones(1, Q, dtype=torch.bool, device=device)
        # The batch's logits indices may repeat a position (a request whose chunk needs no logits points at 0).
        keep, repeat = torch.unique(keep_positions(logits_to_keep, Q, device).long(), return_inverse=True)
        kept_slot = torch.full((Q,), -1, dtype=torch.long, device=device)
        kept_slot[keep] = torch.arange(keep.numel(), device=device)
        position_ids = position_ids.view(1, Q)
        run = _LoopSetup(
            max_iterations=M, exit_threshold=tau, embeds=embeds, valid=valid, attention_mask=None,
            position_ids=position_ids, seq_ids=None, token_index=torch.arange(Q, device=device)[None], cache=None,
            past=0, streams=None, targets=None, keep=keep, kept_slot=kept_slot,
            all_kept=isinstance(logits_to_keep, int) and logits_to_keep == 0, full_logits=True, synchronise=False,
            use_cache=False)
        streams = _PagedStreams(cache, paged_kwargs, cfg, mask, embeds.dtype)
        backbone = self.model
        pos_emb = backbone.rotary_emb(embeds, position_ids)
        mixture = StoppingWeightedMixture(cfg.mixture, 1, Q, keep.numel(), device)
        x, alive = embeds, valid[0]
        depth = torch.zeros(Q, dtype=torch.long, device=device)
        for m in range(1, M + 1):
            depth = depth + alive.long()
            streams.write_depths(depth, cfg)
            h = backbone.norm(backbone.run_layers(x, streams.mask(m - 1), position_ids, pos_emb,
                                                  _PagedDepthView(streams, m - 1)))
            step = self._depth_step(run, m, h, _Packing.everything(alive[None]))
            self._accumulate(run, step, mixture, None)
            if step.last:
                break
            idx = step.cont.nonzero().squeeze(1)
            if idx.numel() == 0:
                break
            t = step.time_index.index_select(0, idx)
            logits = step.logits.index_select(0, idx) if step.logits is not None else None
            x_next = self._next_input(step.embeds.index_select(0, idx), step.hidden.index_select(0, idx), logits)
            x = x.index_put((torch.zeros_like(t), t), x_next.to(x.dtype))
            alive = torch.zeros_like(alive).index_fill(0, t, True)
        logits = mixture.log_probs(depth[None, keep])[:, repeat]
        return TaH2CausalLMOutput(logits=logits, iter_counts=depth[None], rows_per_depth=None)


    # -- the pieces of one iteration: updater (Eq. 9) and decider (Eq. 10) -------------------------------------------
    def _next_input(self, embeds, hidden, logits):
        """Input of the next depth for continuing tokens (flat (N, d) tensors): `next_input`."""
        return next_input(self.config, self.updater, self.model.embed_tokens.weight, embeds, hidden, logits)

    def _continue_logit(self, embeds, hidden, logits) -> torch.Tensor:
        """Decider logit (fp32) per token: `continue_logit`."""
        return continue_logit(self.config, self.decider, embeds, hidden, logits)

    def _reads_topk_in_training(self) -> bool:
        """The learned decider runs as it is (not replaced on the instance, as analysis and tests do), so the training
        read-out can hand it the top-k probabilities it computes with log q(m)[y]."""
        return self.config.decider == "learned" and "_continue_logit" not in self.__dict__

    def _needs_logits_for_decisions(self) -> bool:
        return needs_logits_for_decisions(self.config)

    def _weight_grads_in_place(self, max_iterations: int, device) -> _SharedWeightLinears:
        """The per-depth weight gradients of a looped forward are summed inside the products (`_LinearSharedWeight`);
        off under activation checkpointing (its recompute runs the plain layers), autocast (the saved inputs would not
        match the autocast product's dtype), torch.compile (it traces the plain layers) and
        `weight_grads_in_place = False`."""
        enabled = (self.weight_grads_in_place and max_iterations > 1 and torch.is_grad_enabled()
                   and not self.model.gradient_checkpointing and not torch.is_autocast_enabled(device.type)
                   and not torch.compiler.is_compiling())
        return _SharedWeightLinears(self.modules(), enabled)

    def _unused_parameter_anchor(self) -> torch.Tensor:
        """0 · Σ p over the trainable updater/decider parameters, added to the training loss *inside* forward.

        A step where no token continues leaves the updater (and, with a fixed-weight mixture, the decider) out of the
        graph. Every data-parallel wrapper then needs each parameter to be reached exactly once by the graph of the
        forward's own output: DDP without unused-parameter detection waits for a gradient of every parameter, DDP with
        it marks the unreached ones ready at the end of forward (a term added outside forward would fire their hooks a
        second time), and FSDP reduces every shard. Reaching them here, with a zero coefficient, satisfies all three."""
        params = [p for part in (self.updater, self.decider, self.core_adapter) if part is not None
                  for p in part.parameters() if p.requires_grad]
        if not params:
            return torch.zeros((), device=self.lm_head.weight.device)
        return 0.0 * sum(p.sum() for p in params)

    # -- running the backbone at one depth -----------------------------------------------------------------------------
    def _run_depth(self, streams, stream, x, pack, position_ids, token_index, seq_ids, mode, stream0_mask=None,
                   key_continue=None, collect=None, copy_previous=None):
        """Run the whole backbone (and final norm) once, at stream `stream`, for the tokens `pack` selects."""
        backbone = self.model
        B = x.shape[0]
        q_pos, q_index = pack.gather(position_ids), pack.gather(token_index)
        if pack.flat:  # one flat row: every (row, document) is its own sequence
            q_seq = pack.gather(flat_sequence_ids(seq_ids, B, position_ids.shape[1], x.device))
        else:
            q_seq = pack.gather(seq_ids) if seq_ids is not None else None
        cont = pack.gather(key_continue) & pack.real if key_continue is not None else None
        streams.add_entries(
            stream,
            pos=pack.scatter_rows(q_pos, B, 0),
            valid=pack.scatter_rows(pack.real, B, False),
            index=pack.scatter_rows(q_index, B, 0),
            seq=pack.scatter_rows(q_seq, B, -1) if q_seq is not None else None,
            cont=pack.scatter_rows(cont, B, False) if cont is not None else None,
            rows_hint=(pack.rows if pack.rows is not None else torch.arange(B, device=x.device),
                       pack.rows_host if pack.rows_host is not None else list(range(B)))
            if pack.one_per_row and not pack.identity else None,
        )
        if stream0_mask is not None:
            key_streams, mask = [0], stream0_mask
        else:
            key_streams = [stream] if mode == "same_iter" else list(range(stream + 1))
            keys = streams.key_metadata(key_streams, pack.rows, flat=pack.flat)
            visible = iteration_visibility(mode, q_pos, stream, keys["pos"], keys["iter"], keys["valid"],
                                           key_continue=keys["cont"], query_seq=q_seq, key_seq=keys["seq"])
            mask = iteration_mask(visible, self.config, x.dtype)
        x_j = pack.gather(x)
        view = StreamView(streams, stream, key_streams, pack.rows, B, copy_previous=copy_previous,
                          real=None if pack.one_per_row else pack.real, flat=pack.flat)
        pos_emb = backbone.rotary_emb(x_j, q_pos)
        return backbone.norm(backbone.run_layers(x_j, mask, q_pos, pos_emb, view, collect))

    # -- the named steps of `forward` ----------------------------------------------------------------------------------
    def _loop_knobs(self, max_iterations, exit_threshold) -> tuple[int, float]:
        """M and τ of this call (per-call overrides validated like the config fields)."""
        cfg = self.config
        check_loop_knobs(max_iterations, exit_threshold)
        M = cfg.max_iterations if max_iterations is None else max_iterations
        tau = float(cfg.exit_threshold if exit_threshold is None else exit_threshold)
        if M > 1 and cfg.updater == "learned" and self.updater is None:
            raise ValueError("this checkpoint has no learned updater; max_iterations must be 1")
        return M, tau

    def _setup_loop(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, shift_labels,
                    use_cache, logits_to_keep, max_iterations, exit_threshold, return_mixture_logits,
                    return_loop_records) -> _LoopSetup:
        """Embeddings, padding validity, RoPE positions, packed-document ids, the cache and this call's streams,
        the supervised targets, and which positions' distributions to return."""
        cfg = self.config
        M, tau = self._loop_knobs(max_iterations, exit_threshold)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if return_loop_records and labels is None:
            raise ValueError("return_loop_records needs labels")
        embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = embeds.shape
        device = embeds.device
        if use_cache is None:
            use_cache = cfg.use_cache and not self.training
        if cache is not None or use_cache:
            cache = TaH2Cache.adopt(cache if cache is not None else DynamicCache(), cfg.num_hidden_layers,
                                    ragged_streams=cfg.decider != "exit_gate" and cfg.loop_span is None)
        past = cache.get_seq_length() if cache is not None else 0
        if return_loop_records and past > 0:
            raise ValueError("return_loop_records needs a full teacher-forced forward (no past cache)")

        attention_mask = plain_attention_mask(attention_mask)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("TaH2 builds its own cross-iteration masks: pass a 2-D padding attention_mask (B, past+T)")
        valid = attention_mask[:, -T:].bool() if attention_mask is not None else torch.ones(B, T, dtype=torch.bool,
                                                                                              device=device)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, past, T, device)
        position_ids = position_ids.expand(B, T)
        seq_ids = None
        if attention_mask is None and past == 0 and T > 1 and bool((position_ids[:, 1:] == 0).any()):
            seq_ids = sequence_ids_from_positions(position_ids)  # packed (padding-free) rows: documents stay apart

        targets = None
        if labels is not None:
            # A padding position never runs, so it predicts nothing: with left padding the last pad's target (the first
            # real token) is not supervised, and a padded batch's loss equals its rows run alone.
            targets = shift_targets(labels, shift_labels).masked_fill(~valid, -100)
        keep = keep_positions(logits_to_keep, T, device)
        kept_slot = torch.full((T,), -1, dtype=torch.long, device=device)
        kept_slot[keep] = torch.arange(keep.numel(), device=device)
        # Ranks run the same number of depth passes whenever the call is part of a training objective (training, or an
        # evaluation step that computes the lookahead): sharded wrappers and the lookahead's collectives need it.
        # Plain inference (generate) stays rank-local.
        synchronise = (
            (self.training or return_loop_records) and torch.distributed.is_available()
            and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        )
        streams = CallStreams(cache, cfg.num_hidden_layers, persist_deeper=(cfg.iteration_attention != "causal"),
                              batch_size=B)
        # Training objectives (no cache, several tokens per row) may pack the deeper depths flat (no per-row padding);
        # None = eligible, decided at the first deeper depth (`_advance`).
        eligible = (self.deeper_packing != "per_row" and cache is None and T > 1 and cfg.decider != "exit_gate"
                    and (self.training or return_loop_records))
        streams.flat = None if eligible else False
        return _LoopSetup(
            max_iterations=M, exit_threshold=tau, embeds=embeds, valid=valid, attention_mask=attention_mask,
            position_ids=position_ids, seq_ids=seq_ids, token_index=(torch.arange(T, device=device) + past).expand(B, T),
            cache=cache, past=past, streams=streams,
            targets=targets, keep=keep, kept_slot=kept_slot,
            all_kept=isinstance(logits_to_keep, int) and (logits_to_keep == 0 or logits_to_keep >= T),
            full_logits=labels is None or return_mixture_logits or M == 1, synchronise=synchronise,
            use_cache=bool(use_cache),
        )

    def _backbone_pass(self, run: _LoopSetup, depth: int, x: torch.Tensor, pack: _Packing, collect=None,
                       copy_previous=None):
        """h(m) for the packed tokens. Depth 1 attends like Qwen3 (HF's own causal mask over stream 0); its per-layer
        states go to `collect` (`output_hidden_states` / `output_attentions`)."""
        stream0_mask = None
        if depth == 1:
            stream0_mask = create_causal_mask(config=self.config, inputs_embeds=run.embeds,
                                              attention_mask=run.attention_mask,
                                              cache=run.cache if run.past > 0 else None, position_ids=run.position_ids)
        return self._run_depth(run.streams, depth - 1, x, pack, run.position_ids, run.token_index, run.seq_ids,
                               self.config.iteration_attention, stream0_mask, collect=collect if depth == 1 else None,
                               copy_previous=copy_previous)

    def _depth_step(self, run: _LoopSetup, depth: int, h: torch.Tensor, pack: _Packing, qexit=None) -> DepthStep:
        """LM head and decider on the real tokens of depth m, and their decisions (continue iff g > τ, or sampled)."""
        fb, ft, sel = pack.flat_tokens()
        h_flat, e_flat = h[sel], run.embeds[fb, ft]
        last = depth == run.max_iterations
        kept = run.kept_slot[ft] >= 0
        if run.targets is not None or (not last and self._needs_logits_for_decisions()):
            z_flat = self.lm_head(h_flat)
            z_kept = (z_flat if run.all_kept else z_flat[kept]) if run.full_logits else None
        else:
            z_flat, z_kept = None, self.lm_head(h_flat if run.all_kept else h_flat[kept])
        logp_target, top = None, None
        if run.targets is not None:
            y = run.targets.clamp(min=0)[fb, ft]
            if not last and self._reads_topk_in_training():  # one pass over the logits for both read-outs
                logp_target, top = target_log_prob_and_topk(z_flat, y, min(self.decider.topk, z_flat.shape[-1]))
            else:
                logp_target = target_log_prob(z_flat, y)
        if last:
            logit, g, cont = None, torch.zeros(fb.shape, device=h.device), torch.zeros_like(fb, dtype=torch.bool)
        else:
            logit = self._continue_logit(e_flat, h_flat, z_flat) if top is None else self.decider(e_flat, h_flat, z_flat,
                                                                                                top_probs=top)
            g = torch.sigmoid(logit)
            cont = continue_decisions(self.config, g, run.exit_threshold)
        if pack.identity and pack.one_per_row:  # depth 1 of a one-token call lists padding rows too
            cont = cont & run.valid[fb, ft]
        step = DepthStep(depth=depth, last=last, batch_index=fb, time_index=ft, slots=sel, hidden=h_flat,
                         embeds=e_flat, logits=z_flat, kept=kept, kept_logits=z_kept, continue_logit=logit,
                         continue_prob=g, cont=cont, target_logprob=logp_target)
        if qexit is not None:  # Ouro Stage II: the output depth of each token follows the cumulative exit probability
            step.emit = qexit.emit(step)
            if not last:
                qexit.update(step)
        return step

    def _advance(self, run: _LoopSetup, step: DepthStep, x: torch.Tensor,
                 pack: _Packing) -> tuple[torch.Tensor, _Packing | None]:
        """Updater inputs x(m+1) = U(e, h(m)) of the continuing tokens, and their packing for depth m + 1 (None when no
        token continues). Reading the continue decisions is the one host sync of a decoding step's depth boundary:
        a one-token call reads them as a host list, from which every later shape and the ragged cache's row counts
        follow."""
        B, T = run.valid.shape
        rows_host = None
        if T == 1 and pack.one_per_row and self.config.decider != "exit_gate":
            flags = step.cont.tolist()
            previous = range(B) if pack.rows_host is None else pack.rows_host
            picked = [i for i, f in enumerate(flags) if f]
            rows_host = [previous[i] for i in picked]
            idx = torch.tensor(picked, dtype=torch.long, device=x.device)
        else:
            idx = step.cont.nonzero().squeeze(1)
        cb, ct = step.batch_index.index_select(0, idx), step.time_index.index_select(0, idx)
        logits = step.logits.index_select(0, idx) if step.logits is not None else None
        x_next = self._next_input(step.embeds.index_select(0, idx), step.hidden.index_select(0, idx), logits)
        x = x.index_put((cb, ct), x_next.to(x.dtype))
        if self.config.decider == "exit_gate":  # dense streams in time order (exited tokens' K/V get copied)
            return x, _Packing.everything(run.valid)
        if rows_host is not None:
            return x, _Packing.of_rows(cb, rows_host, B)
        active = torch.zeros(B, T, dtype=torch.bool, device=x.device).index_put((cb, ct), torch.ones_like(cb, dtype=torch.bool))
        if run.streams.flat is None:  # one layout for every deeper stream of the call
            run.streams.flat = self.deeper_packing == "flat" or self._flat_is_cheaper(active)
        return x, (_Packing.flat_of(active) if run.streams.flat else _Packing.of(active))

    def _flat_is_cheaper(self, active: torch.Tensor) -> bool:
        """Does the flat packing of `active` (B, T) cost fewer backbone FLOPs than the per-row one? Flat runs only the
        N active tokens through the linear layers, but under a dense mask each query also scores the other rows' keys
        (B·T + N of them instead of T + width); flex's BlockMask skips those blocks, so flex always packs flat."""
        if self.config._attn_implementation == "flex_attention":
            return True
        cfg = self.config
        counts = active.sum(1).tolist()
        B, T = active.shape
        n, width, rows = sum(counts), max(counts, default=0), sum(1 for c in counts if c)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        linear = 2 * cfg.hidden_size * (hd * 2 * (cfg.num_attention_heads + cfg.num_key_value_heads)
                                        + 3 * cfg.intermediate_size)  # FLOPs per token per layer
        pair = 4 * cfg.num_attention_heads * hd  # FLOPs per (query, key) pair per layer
        per_row = rows * width * (linear + pair * (T + width))
        return n * (linear + pair * (B * T + n)) <= per_row

    def _accumulate(self, run: _LoopSetup, step: DepthStep, mixture: StoppingWeightedMixture, recorder) -> None:
        """Add depth m to the mixture (the kept positions' distributions and/or log q[y]) and to the loop records.

        Under Q-exit (`step.emit`) only tokens that have not exited take this depth's distribution; the records keep
        every executed token (Ouro Stage II's gate targets need ℓ(m) and ℓ(m+1) of all of them)."""
        index = (step.batch_index, step.time_index)
        log_w = mixture.log_weights(step)
        emit = step.emit if step.emit is not None else torch.ones_like(step.kept)
        logp_target = None
        if run.targets is not None:
            logp_target = step.target_logprob
            if recorder is not None:
                recorder.add(step, logp_target)
        if step.kept_logits is not None and run.all_kept and step.emit is None:  # no boolean indexing (no host sync)
            mixture.add_distribution((index[0], run.kept_slot[index[1]]), log_w, step.kept_logits)
        elif step.kept_logits is not None:
            kept_emit = emit[step.kept]
            slot = (index[0][step.kept][kept_emit], run.kept_slot[index[1][step.kept][kept_emit]])
            mixture.add_distribution(slot, log_w[step.kept][kept_emit], step.kept_logits[kept_emit])
        if logp_target is not None and step.emit is None:
            mixture.add_target(index, log_w, logp_target)
        elif logp_target is not None:
            mixture.add_target((index[0][emit], index[1][emit]), log_w[emit], logp_target[emit])

    def _forward_huginn(self, run: _LoopSetup, labels, output_hidden_states, output_attentions, return_loop_records,
                        kwargs):
        """Huginn-style baseline: prelude (layers before `loop_span`) once → z; the core layers M times with
        u(1) = z and u(m+1) = adapter(r(m), z) (or r(m) without adapter); the coda once on r(M); the LM head once.
        Every token runs every core iteration; iteration m keeps its own K/V stream (stream 0 also holds the prelude and
        coda layers, whose indices differ), so each layer call is plain causal attention over its own slot."""
        cfg, M = self.config, run.max_iterations
        if return_loop_records:
            raise ValueError("return_loop_records (lookahead supervision) does not apply to the Huginn-style baseline")
        start, end = cfg.loop_span
        L, B, T = cfg.num_hidden_layers, run.embeds.shape[0], run.embeds.shape[1]
        backbone, cache = self.model, run.cache
        if cache is not None:
            cache.ensure_streams(M)
        mask = create_causal_mask(config=cfg, inputs_embeds=run.embeds, attention_mask=run.attention_mask,
                                  cache=cache if run.past > 0 else None, position_ids=run.position_ids)
        pos_emb = backbone.rotary_emb(run.embeds, run.position_ids)
        collect = LayerCollector.requested(cfg, output_hidden_states, output_attentions)

        def layers(hidden, span, stream):
            view = LoopCacheView(cache, stream * (L + 1)) if cache is not None else None
            return backbone.run_layers(hidden, mask, run.position_ids, pos_emb, view, collect, span=span)

        z = layers(run.embeds, (0, start), 0)
        u = z
        for m in range(1, M + 1):
            r = layers(u, (start, end), m - 1)
            if m < M:
                u = self.core_adapter(r, z) if self.core_adapter is not None else r
        h = backbone.norm(layers(r, (end, L), 0))
        logits = self.lm_head(h[:, run.keep])
        if cache is not None:  # every stream is dense: the metadata lets crop / reorder treat them like TaH2's
            for stream in range(M):
                cache.append_metadata(stream, run.position_ids, run.valid, run.token_index,
                                      run.valid.long() * M if stream == 0 else torch.zeros_like(run.token_index))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=None, shift_labels=run.targets,
                                      vocab_size=cfg.vocab_size, **kwargs)
            if self.training:
                loss = loss + self._unused_parameter_anchor()
        want_hidden = collect is not None and collect.want_hidden
        return TaH2CausalLMOutput(
            loss=loss, logits=logits, cache=cache if run.use_cache else None, iter_counts=run.valid.long() * M,
            continue_probs=torch.where(run.valid[..., None], 1.0, float("nan")).expand(B, T, M - 1).clone(),
            hidden_states=collect.hidden_states(h) if want_hidden else None,
            attentions=tuple(collect.attentions) if collect is not None and collect.attentions is not None else None,
            rows_per_depth=(B * T,) * M,
        )

    def _loss(self, run: _LoopSetup, labels, logits, mixture, iter_counts, kwargs):
        """Standard (M = 1): HF's loss on the raw logits; otherwise the mixture NLL. In training, plus the zero-weight
        anchor over the updater/decider parameters (`_unused_parameter_anchor`)."""
        if labels is None:
            return None
        if run.max_iterations == 1:
            loss = self.loss_function(logits=logits, labels=None, shift_labels=run.targets,
                                      vocab_size=self.config.vocab_size, **kwargs)
        else:
            loss = self._mixture_nll(mixture, run.targets, iter_counts, kwargs.get("num_items_in_batch"))
        return loss + self._unused_parameter_anchor() if self.training else loss

    def _mixture_nll(self, mixture: StoppingWeightedMixture, targets, iter_counts, num_items_in_batch):
        """(1/N) Σ_t −log q_t[y_t] over supervised tokens; N = `num_items_in_batch` (the Trainer's global count)."""
        device = iter_counts.device
        supervised = targets != -100
        nll = -torch.where(supervised, mixture.target_log_probs(iter_counts), torch.zeros((), device=device)).sum()
        n = supervised.sum() if num_items_in_batch is None else num_items_in_batch
        return nll / torch.as_tensor(n, device=device).clamp(min=1)

    @can_return_tuple
    @accepts_cache_kwarg
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        max_iterations: int | None = None,
        exit_threshold: float | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_mixture_logits: bool = False,
        return_loop_records: bool = False,
        **kwargs,
    ) -> TaH2CausalLMOutput:
        r"""
        max_iterations (`int`, *optional*): maximum depth M for this call (>= 1).
        exit_threshold (`float`, *optional*): τ for this call, in (0, 1).
        return_mixture_logits (`bool`): with `labels`, also return the full-vocabulary mixture (not materialised by
            default in training: the loss only needs log q_t[y_t]).
        return_loop_records (`bool`): return `TaH2LoopRecords` (per-depth losses, decider logits) for lookahead
            supervision; needs `labels`.
        output_hidden_states (`bool`): `hidden_states` = the depth-1 pass's per-layer states (Qwen3's convention,
            so M = 1 matches Qwen3) and `iteration_hidden_states` = h(m) of every depth.
        output_attentions (`bool`): `attentions` = the depth-1 pass's per-layer weights (eager attention only; every
            depth's attention, with its cross-iteration keys, comes from `hf_loops.analysis.capture_trace`).
        `logits` are the mixture's log-probabilities (Qwen3's raw logits when M = 1).
        """
        if is_paged_cache(cache):  # transformers' continuous batching (generate_batch, serve --continuous-batching)
            if labels is not None:
                raise ValueError("labels are not supported with transformers' paged (continuous-batching) cache")
            paged_kwargs = {k: kwargs[k] for k in ("read_index", "write_index", "cu_seq_lens_k", "max_length_k")
                            if k in kwargs}
            return self._forward_paged(input_ids, position_ids, cache, attention_mask, inputs_embeds, logits_to_keep,
                                       paged_kwargs)
        run = self._setup_loop(input_ids, attention_mask, position_ids, cache, inputs_embeds, labels,
                               kwargs.pop("shift_labels", None), use_cache, logits_to_keep, max_iterations,
                               exit_threshold, return_mixture_logits, return_loop_records)
        M, (B, T, _), device = run.max_iterations, run.embeds.shape, run.embeds.device
        if self.config.loop_span is not None:
            return self._forward_huginn(run, labels, output_hidden_states, output_attentions, return_loop_records,
                                        kwargs)
        mixture = StoppingWeightedMixture(self.config.mixture, B, T, run.keep.numel(), device)
        recorder = _LoopRecorder(run.embeds) if return_loop_records else None
        collect = LayerCollector.requested(self.config, output_hidden_states, output_attentions)
        trace = _DepthTrace(run, want_hidden=collect is not None and collect.want_hidden)
        qexit = QExit(run.valid, run.exit_threshold) if self.config.decider == "exit_gate" else None
        x, pack, copy_previous, raw_logits = run.embeds, _Packing.everything(run.valid), None, None
        with self._weight_grads_in_place(M, device):
            for depth in range(1, M + 1):
                h = self._backbone_pass(run, depth, x, pack, collect, copy_previous)
                if M == 1:  # Standard: Qwen3's raw logits, padding positions included, bit-exact
                    raw_logits = self.lm_head(h[:, run.keep])
                    trace.add_full_pass(h)
                    break
                step = self._depth_step(run, depth, h, pack, qexit)
                trace.add(step, h)
                self._accumulate(run, step, mixture, recorder)
                if step.last:
                    break
                if qexit is not None and self.config.exit_kv_fill == "copy_last":
                    copy_previous = qexit.exited()
                x, pack = self._advance(run, step, x, pack)
                if not _any_on_any_rank(pack is not None, run.synchronise):
                    break
                pack = pack or _Packing.placeholder(B, device, T if run.streams.flat else 0)
        iter_counts = trace.iter_counts * run.valid  # one-token calls list padding rows at depth 1
        run.streams.commit(iter_counts)

        logits = raw_logits if M == 1 else mixture.log_probs(iter_counts[:, run.keep])
        records = None if recorder is None else recorder.records(
            targets=run.targets, position_ids=run.position_ids, seq_ids=run.seq_ids, streams=run.streams,
            max_iterations=M, synchronised=run.synchronise)
        return TaH2CausalLMOutput(
            loss=self._loss(run, labels, logits, mixture, iter_counts, kwargs),
            logits=logits,
            cache=run.cache if run.use_cache else None,
            iter_counts=iter_counts,
            continue_probs=trace.continue_probs.masked_fill(~run.valid[..., None], float("nan")),
            hidden_states=collect.hidden_states(trace.first_pass) if trace.want_hidden else None,
            attentions=tuple(collect.attentions) if collect is not None and collect.attentions is not None else None,
            iteration_hidden_states=tuple(trace.iteration_hidden) if trace.want_hidden else None,
            rows_per_depth=tuple(trace.rows_per_depth),
            loop_records=records,
        )

    @torch.no_grad()
    def lookahead_logprobs(self, records: TaH2LoopRecords) -> list:
        """One extra no-gradient iteration per boundary m = 1..M−1 (lookahead): every token that executed depth m runs
        depth m+1 from U(e, h(m)), seeing the main forward's streams 0..m−1, the main depth-(m+1) states of tokens that
        really continued (`duo_posterior`), and its own lookahead state — never another token's lookahead state.

        Returns, per boundary m, log q(m+1)[y_t] as a (B, T) fp32 tensor (0 where the token did not execute depth m).

        Under `duo` attention a continuing token's lookahead state *is* its main depth-(m+1) state (same input
        U(e, h(m)), same visible keys: streams 0..m−1, the continuing tokens' depth-(m+1) states and its own), so only
        the tokens that stopped at m run: their queries read the continuing tokens' depth-(m+1) K/V from the main
        forward's stream m (`duo_posterior` at stream m+1: every key of streams 0..m up to the query's position, plus
        its own lookahead state), and the continuing tokens take ℓ(m+1) of the main forward. Same values as re-running
        all N_m tokens (up to float rounding) for N_m − N_{m+1} tokens' work. Other modes (`same_iter`, where the main
        depth m+1 sees other keys) re-run every token that executed depth m.
        """
        B, T, _ = records.embeds.shape
        device = records.embeds.device
        token_index = torch.arange(T, device=device).expand(B, T)
        safe_targets = records.targets.clamp(min=0)
        synchronise = records.synchronised
        reuse_main = self.config.iteration_attention == "duo"
        out = []
        for m in range(1, min(len(records.executed), records.max_iterations - 1) + 1):
            active = records.executed[m - 1]
            ran_next = m < len(records.executed)  # the main forward ran depth m+1 (stream m exists, maybe empty)
            continued = records.executed[m] if ran_next else torch.zeros_like(active)
            reuse = reuse_main and ran_next
            queries = active & ~continued if reuse else active
            base = records.token_logprob[m].clone() if reuse else torch.zeros(B, T, device=device)
            flat = bool(records.streams.flat)  # the layout of the main forward's deeper streams
            pack = _Packing.flat_of(queries) if flat else _Packing.of(queries)
            if not _any_on_any_rank(pack is not None, synchronise):
                out.append(base)
                continue
            pack = pack or _Packing.placeholder(B, device, T if flat else 0)
            fb, ft, sel = pack.flat_tokens()
            e, h = records.embeds[fb, ft], records.hidden[m - 1][fb, ft]
            z_prev = self.lm_head(h) if self.config.updater == "topk_embedding" else None
            x = torch.zeros_like(records.embeds).index_put((fb, ft), self._next_input(e, h, z_prev).to(e.dtype))
            look = CallStreams(None, self.config.num_hidden_layers, persist_deeper=True)
            look.flat = flat
            shared = list(range(m + 1)) if reuse else list(range(m))
            look.share_streams(records.streams, shared)
            h_look = self._run_depth(look, len(shared), x, pack, records.position_ids, token_index, records.seq_ids,
                                     "duo_posterior", key_continue=torch.zeros_like(active) if reuse else continued)
            logp = head_target_log_prob(self.lm_head, h_look[sel], safe_targets[fb, ft])
            out.append(base.index_put((fb, ft), logp))
        return out


__all__ = [
    "TaH2CausalLMOutput",
    "TaH2Decider",
    "TaH2ForCausalLM",
    "TaH2LoopRecords",
    "TaH2Model",
    "TaH2PreTrainedModel",
    "TaH2Updater",
    "iteration_visibility",
]
