"""Continuous-depth decoding for TaH2's `generate` (greedy and multinomial sampling).

Lockstep decoding runs every depth of a step as its own pass of the layer stack: when any row continues, the deeper
pass re-reads every weight for the few rows that need it. All depths share the weights, so one pass can serve depth-1
queries of some rows and depth-m queries of others. Here each step runs ONE pass over one query per row: a row whose
token continues runs its next depth in the next step, together with the other rows' new tokens; its next token waits
one step. A depth-m query of position p sees the streams its attention mode allows at positions ≤ p, all of which were
computed in earlier steps (or in this step: its own new entry), so tokens and per-token depths equal lockstep
decoding.

Keys live in one buffer per layer, one column per step (every row appends exactly one entry per step: its query, at
whatever stream), each entry tagged with its RoPE position, stream and validity; the visibility mask of a step is
built from those tags once and shared by the layers. The prefill is the ordinary forward (the prefill cascade), whose
cache is copied into the buffers.

This file ships as Hub remote code next to modeling_tah2.py: it imports only torch, transformers and its siblings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.generation import GenerationMixin
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .cache_tah2 import RaggedLayout, iteration_visibility
from .kv_quant import QuantizedLoopLayer
from .loop_utils import iteration_mask

__all__ = ["TaH2GenerationMixin", "continuous_depth_unsupported"]

# Processors that read only the scores (not the ids, not the batch position): all finishing rows go through them at once.
_SCORE_ONLY_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                          TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper, InfNanRemoveLogitsProcessor,
                          LogitNormalization, SuppressTokensLogitsProcessor)
# Processors that depend on the batch position of a row or keep per-step state of the whole batch: lockstep only.
_BATCH_COUPLED_PROCESSORS = ("PrefixConstrainedLogitsProcessor", "ClassifierFreeGuidanceLogitsProcessor",
                             "UnbatchedClassifierFreeGuidanceLogitsProcessor", "AlternatingCodebooksLogitsProcessor",
                             "WhisperTimeStampLogitsProcessor", "WhisperNoSpeechDetection",
                             "BarkEosPrioritizerLogitsProcessor", "SynthIDTextWatermarkLogitsProcessor")
# Model kwargs the continuous-depth loop understands (anything else goes to the lockstep path).
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep",
                       "max_iterations", "exit_threshold", "inputs_embeds"}
_ATTENTION_BACKENDS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


def continuous_depth_unsupported(model, generation_config, model_kwargs, logits_processor, streamer,
                                 synced_gpus, batch_size, input_len: int = 0) -> str | None:
    """Why this `generate` call must decode in lockstep, or None when continuous-depth decoding applies."""
    cfg = model.config
    switch = getattr(model, "_tah2_continuous_depth", None)
    if switch is False or (switch is None and not getattr(model, "continuous_depth_decoding", True)):
        return "switched off (continuous_depth=False)"
    sampled = generation_config.do_sample or cfg.decision_mode == "sample"
    if switch is None and sampled and batch_size > 1:
        # rows draw at different steps, so a seed would give other tokens than lockstep (and use_cache=False) does
        return "sampling at batch > 1 keeps lockstep's draws for a given seed (continuous_depth=True opts in)"
    M, _ = model._loop_knobs(model_kwargs.get("max_iterations"), model_kwargs.get("exit_threshold"))
    if M == 1:
        return "max_iterations = 1 (nothing to interleave)"
    if cfg.loop_span is not None or cfg.decider == "exit_gate":
        return "Huginn-style core loop / Ouro exit gate (dense streams, every depth runs)"
    if synced_gpus:
        return "synced_gpus"
    if generation_config.max_length is None or generation_config.max_length - input_len < 1:
        return "max_length leaves no new token"
    if generation_config.return_dict_in_generate:
        return "return_dict_in_generate (scores, attentions, hidden states and the cache come from the lockstep path)"
    if not model_kwargs.get("use_cache", True):
        return "use_cache=False"
    if streamer is not None and batch_size > 1:
        return "a streamer with more than one row (rows finish tokens at different steps)"
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and (getattr(cache, "_is_user_defined", False) or cache.get_seq_length() > 0):
        return "a cache passed by the caller (it must hold the whole generation)"
    if cfg._attn_implementation not in _ATTENTION_BACKENDS:
        return f"attention backend {cfg._attn_implementation!r}"
    unknown = [k for k, v in model_kwargs.items() if v is not None and k not in _KNOWN_MODEL_KWARGS]
    if unknown:
        return f"model kwargs {unknown}"
    coupled = [type(p).__name__ for p in logits_processor if type(p).__name__ in _BATCH_COUPLED_PROCESSORS]
    if coupled:
        return f"logits processors that depend on the batch layout: {coupled}"
    return None


class _StepKV:
    """Keys and values of every layer, one column per decoding step after the prompt's entries, with per-entry
    metadata (position, stream, validity). It is the `cache=` object the shared layers receive: `update` writes the
    step's column and returns the keys written so far.

    A quantized loop cache (kv_quant.py) keeps its quantization here: each layer's entries live in a
    `QuantizedLoopLayer` (the prefill's entries, then one column per step), whose fp window holds the latest entries."""

    def __init__(self, cache, num_layers: int, batch_size: int, reserve: int):
        keys, values, pos, iters, valid = self._from_cache(cache, num_layers, batch_size)
        self.length = pos.shape[1]
        cap = self.length + max(reserve, 1)
        quant = getattr(cache, "loop_kv_quant", None)
        self.quantized = None
        if quant is not None:
            self.quantized = [QuantizedLoopLayer(quant) for _ in range(num_layers)]
            for layer, k, v in zip(self.quantized, keys, values, strict=True):
                layer.update(k, v)
            keys = values = []
        self.keys = [self._grow(k, cap) for k in keys]
        self.values = [self._grow(v, cap) for v in values]
        self.pos, self.iter, self.valid = self._grow(pos, cap), self._grow(iters, cap), self._grow(valid, cap)
        self.column = -1
        self.steps = 0

    @staticmethod
    def _from_cache(cache, num_layers, batch_size):
        """Stream 0 (dense) and every deeper stream (row-padded view of the ragged entries) of the prefill's cache."""
        keys, values = [[] for _ in range(num_layers)], [[] for _ in range(num_layers)]
        pos, iters, valid = [], [], []
        for stream in range(cache.num_streams):
            meta = cache.stream_metadata(stream, batch_size)
            if meta is None:
                continue
            for layer in range(num_layers):
                stored = cache.layers[cache.kv_slot(stream, layer)]
                like = cache.layers[cache.kv_slot(0, layer)].keys
                if cache.is_ragged(stream):
                    k = RaggedLayout.read(stored.keys, meta["gather"], like)
                    v = RaggedLayout.read(stored.values, meta["gather"], like)
                else:
                    k, v = stored.keys, stored.values
                keys[layer].append(k)
                values[layer].append(v)
            pos.append(meta["pos"])
            iters.append(torch.full_like(meta["pos"], stream))
            valid.append(meta["valid"])
        cat = lambda parts: torch.cat(parts, dim=-2 if parts[0].dim() == 4 else 1)  # noqa: E731
        return [cat(k) for k in keys], [cat(v) for v in values], cat(pos), cat(iters), cat(valid)

    @staticmethod
    def _grow(t: torch.Tensor, capacity: int) -> torch.Tensor:
        """A copy of `t` with room for `capacity` entries along its entry dimension (dim 2 of K/V, dim 1 of tags)."""
        dim = 2 if t.dim() == 4 else 1
        shape = list(t.shape)
        shape[dim] = capacity
        out = t.new_zeros(shape)
        out.narrow(dim, 0, t.shape[dim]).copy_(t)
        return out

    def add_column(self, pos: torch.Tensor, stream: torch.Tensor, valid: torch.Tensor) -> None:
        """Open the next step's column with each row's query tags."""
        self.column = self.length
        self.length += 1
        self.steps += 1
        if self.length > self.pos.shape[1]:  # grow by half (amortised copies, at most 1.5× the entries held)
            cap = self.pos.shape[1] + max(256, self.pos.shape[1] // 2)
            self.keys = [self._grow(k, cap) for k in self.keys]
            self.values = [self._grow(v, cap) for v in self.values]
            self.pos, self.iter, self.valid = (self._grow(self.pos, cap), self._grow(self.iter, cap),
                                               self._grow(self.valid, cap))
        self.pos[:, self.column] = pos
        self.iter[:, self.column] = stream
        self.valid[:, self.column] = valid

    def visibility(self, mode: str, q_pos: torch.Tensor, q_stream: torch.Tensor) -> torch.Tensor:
        """(B, 1, S) which entries each row's query may attend to."""
        n = self.length
        return iteration_visibility(mode, q_pos[:, None], q_stream[:, None], self.pos[:, :n], self.iter[:, :n],
                                    self.valid[:, :n])

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only the batch rows `keep` (rows that are done leave the pass)."""
        for layer in self.quantized or ():
            layer.batch_select_indices(keep)
        self.keys = [k.index_select(0, keep) for k in self.keys]
        self.values = [v.index_select(0, keep) for v in self.values]
        self.pos, self.iter, self.valid = (self.pos.index_select(0, keep), self.iter.index_select(0, keep),
                                           self.valid.index_select(0, keep))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        c = self.column
        if self.quantized is not None:  # every layer appends exactly one column per step
            return self.quantized[layer_idx].update(key_states[:, :, :1], value_states[:, :, :1])
        self.keys[layer_idx][:, :, c] = key_states[:, :, 0]
        self.values[layer_idx][:, :, c] = value_states[:, :, 0]
        return self.keys[layer_idx][:, :, : c + 1], self.values[layer_idx][:, :, : c + 1]


class _Stopping:
    """Stopping criteria and logits processors applied to the rows that finish a token in a step.

    Rows finish tokens at different steps, so they hold different numbers of tokens, while HF's processors and
    criteria take a rectangle of ids (and some keep per-row state, e.g. a per-row prompt length). Each group of
    finishing rows with equal length therefore goes through them as the whole batch, every row in its place, with the
    ids cut at the group's length; only the group's rows of the result are used. The common cases take all finishing
    rows at once: processors that read only the scores, and the max-length / EOS criteria (done here)."""

    def __init__(self, logits_processor, stopping_criteria, prompt_len: int):
        self.processors = logits_processor
        self.criteria = stopping_criteria
        self.prompt_len = prompt_len
        self.score_only = all(isinstance(p, _SCORE_ONLY_PROCESSORS) for p in logits_processor)
        self.eos = [c.eos_token_id for c in stopping_criteria if isinstance(c, EosTokenCriteria)]
        self.simple_criteria = all(isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in stopping_criteria)
        # only the length can stop a row: the host counts it, the device flags never change
        self.length_only = all(isinstance(c, MaxLengthCriteria) for c in stopping_criteria)

    def groups(self, rows: list[int], counts: list[int]) -> list[tuple[list[int], int]]:
        """(rows, number of generated tokens) groups; count −1: one group of every finishing row (fast path)."""
        if self.score_only and self.simple_criteria:
            return [(rows, -1)]
        by_count: dict[int, list[int]] = {}
        for r in rows:
            by_count.setdefault(counts[r], []).append(r)
        return [(group, count) for count, group in sorted(by_count.items())]

    def scores(self, ids, rows_t, slots_t, count: int, log_q):
        """Processed scores of the group (batch rows `rows_t`, rows `slots_t` of `log_q`: the pass's log q)."""
        mine = log_q.index_select(0, slots_t)
        if len(self.processors) == 0:
            return mine
        if count < 0:  # score-only processors: per row, the ids are never read
            return self.processors(ids[:, : self.prompt_len].index_select(0, rows_t), mine)
        # the whole batch, every row in its place (rows outside the group get zeros; their result is not used)
        full = log_q.new_zeros((ids.shape[0], log_q.shape[-1])).index_copy(0, rows_t, mine)
        processed = self.processors(ids[:, : self.prompt_len + count], full)
        return processed.index_select(0, rows_t)

    def done(self, ids, rows_t, count: int, tokens, scores) -> torch.Tensor:
        """(n,) bool: which of the group's rows stop after `tokens` (their new tokens, already written to `ids`)."""
        if count < 0:
            done = torch.zeros_like(tokens, dtype=torch.bool)
            for eos in self.eos:
                done = done | torch.isin(tokens, eos.to(tokens.device))
            return done
        full = scores.new_zeros((ids.shape[0], scores.shape[-1])).index_copy(0, rows_t, scores)
        return self.criteria(ids[:, : self.prompt_len + count + 1], full).index_select(0, rows_t)


class _RowState:
    """Host-side bookkeeping of every row: generated tokens, current depth, and whether it still computes."""

    def __init__(self, batch_size: int, max_new: int, pad_finished: bool):
        self.count = [1] * batch_size  # tokens generated (the prefill produced the first)
        self.depth = [0] * batch_size  # stream index of the row's pending query
        self.done_at: list[int | None] = [None] * batch_size
        self.depths: list[list[int]] = [[] for _ in range(batch_size)]  # executed depth of every decoded input token
        self.max_new, self.pad_finished = max_new, pad_finished

    def mark_done(self, flags: list) -> None:
        for r, f in enumerate(flags):
            if f and self.done_at[r] is None:
                self.done_at[r] = self.count[r]
        for r, n in enumerate(self.count):
            if n >= self.max_new and self.done_at[r] is None:
                self.done_at[r] = n

    def target(self) -> int | None:
        """Output length once every row is done: lockstep stops when the last row stops."""
        if any(d is None for d in self.done_at):
            return None
        return max(self.done_at)

    def computing(self) -> list[bool]:
        """Rows that run a query this step. With EOS criteria a done row gets padding, as in lockstep; without, lockstep
        keeps generating real tokens for done rows until every row is done, so they keep going up to that length."""
        target = self.target()
        if self.pad_finished:
            return [d is None for d in self.done_at]
        return [n < self.max_new and (target is None or n < target) for n in self.count]


@torch.no_grad()
def continuous_depth_sample(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                            model_kwargs) -> torch.LongTensor:
    """Greedy / multinomial decoding with one pass of the layer stack per step over mixed depths (see module doc).
    Returns the sequences exactly as `GenerationMixin._sample` does (prompt + new tokens, padding after a stop)."""
    cfg = model.config
    M, tau = model._loop_knobs(model_kwargs.get("max_iterations"), model_kwargs.get("exit_threshold"))
    B, P = input_ids.shape
    device = input_ids.device
    max_new = generation_config.max_length - P
    pad = generation_config._pad_token_tensor
    eos_criteria = any(hasattr(c, "eos_token_id") for c in stopping_criteria)

    outputs = model._prefill(input_ids, generation_config, model_kwargs)
    cache = outputs.cache
    ids = torch.zeros((B, P + max_new), dtype=torch.long, device=device)
    if pad is not None:  # a stopped row's later tokens are padding, as in lockstep (no host read of the pad id)
        ids.copy_(pad.to(device=device, dtype=torch.long).expand_as(ids))
    ids[:, :P] = input_ids
    stopping = _Stopping(logits_processor, stopping_criteria, P)

    # First token: every row has the same length, as in lockstep.
    first_scores = logits_processor(input_ids, outputs.logits[:, -1].to(dtype=torch.float32))
    tokens = _pick(first_scores, generation_config.do_sample)
    ids[:, P] = tokens
    done = stopping_criteria(ids[:, : P + 1], first_scores)
    if streamer is not None:
        streamer.put(tokens.cpu())
    meta0 = cache.stream_metadata(0)
    q_pos = meta0["pos"][:, -1] + 1
    kv = _StepKV(cache, cfg.num_hidden_layers, B, reserve=min(max_new * M, 256))
    del outputs
    cache.reset()  # the prefill's states now live in `kv`

    embed = model.model.embed_tokens
    # Device state is kept for the computing rows only, in the order of `alive` (their batch rows): a row that is done
    # leaves the pass (the batch is compacted), so the tail of a batch, where a few deep rows finish their tokens,
    # costs their rows only. `ids`, `done` and the host bookkeeping stay in batch rows.
    st = _Compact(e=embed(tokens), q_pos=q_pos, device=device, batch=B, vocab=cfg.vocab_size)
    rows = _RowState(B, max_new, pad_finished=eos_criteria)
    rows.mark_done([False] * B)
    computing = rows.computing()
    alive = list(range(B))

    while any(computing):
        if len(alive) != sum(computing):  # rows only ever leave: compact once per change, not per step
            keep = [i for i, r in enumerate(alive) if computing[r]]
            alive = [alive[i] for i in keep]
            st.select(torch.tensor(keep, dtype=torch.long, device=device), kv)
        n = len(alive)
        h, z = _one_pass(model, kv, st.x, st.q_pos, st.q_stream, st.running(n))
        can_continue = [i for i, r in enumerate(alive) if rows.depth[r] < M - 1]
        cont = _decide_and_mix(model, st, h, z, M, tau, can_continue)
        flags = torch.cat([cont, done]).tolist()  # the step's one host read: n continue flags, then B stop flags
        rows.mark_done(flags[n:])
        # A row whose stop (EOS) we learn only now ran a query this step: with padding after a stop, drop it.
        active = [not (rows.pad_finished and rows.done_at[r] is not None) for r in alive]
        cont_slots = [i for i in range(n) if active[i] and flags[i]]
        finish_slots = [i for i in range(n) if active[i] and not flags[i]]
        if cont_slots:
            _advance_depth(model, st, cont_slots, h, z)
            for i in cont_slots:
                rows.depth[alive[i]] += 1
        if finish_slots:
            log_q = st.log_mix
            if cfg.mixture == "even":
                depth_now = torch.tensor([rows.depth[r] + 1 for r in alive], dtype=torch.float32, device=device)
                log_q = st.log_mix - torch.log(depth_now)[:, None]
            done, slots_t, tok = _emit_tokens(stopping, ids, log_q, alive, finish_slots, rows,
                                              generation_config.do_sample, done)
            if streamer is not None:
                streamer.put(tok.cpu())
            st.new_tokens(slots_t, embed(tok))
        rows.mark_done([False] * B)
        computing = rows.computing()

    if streamer is not None:
        streamer.end()
    n_out = rows.target() if rows.target() is not None else max(rows.count)
    model._last_decode_depths = [d[: max(n_out - 1, 0)] for d in rows.depths]
    model._last_decode_steps = kv.steps
    return ids[:, : P + n_out]


class _Compact:
    """Per-row device state of the computing rows (one entry per row of the pass): embedding e of the pending token,
    layer input x, query position and stream, remaining stop mass R and the log mixture."""

    def __init__(self, e, q_pos, device, batch: int, vocab: int):
        self.e, self.x, self.q_pos = e, e, q_pos
        self.q_stream = torch.zeros(batch, dtype=torch.long, device=device)
        self.remaining = torch.ones(batch, dtype=torch.float32, device=device)
        self.log_mix = torch.full((batch, vocab), float("-inf"), dtype=torch.float32, device=device)
        self._running = {}

    def running(self, n: int) -> torch.Tensor:
        """All rows of the pass compute (done rows were compacted out): a cached all-true mask per batch size."""
        if n not in self._running:
            self._running[n] = torch.ones(n, dtype=torch.bool, device=self.e.device)
        return self._running[n]

    def select(self, keep: torch.Tensor, kv: _StepKV) -> None:
        """Keep the rows `keep` (indices into the current rows), here and in the key/value buffers."""
        for name in ("e", "x", "q_pos", "q_stream", "remaining", "log_mix"):
            setattr(self, name, getattr(self, name).index_select(0, keep))
        kv.select_rows(keep)

    def new_tokens(self, slots: torch.Tensor, e_new: torch.Tensor) -> None:
        """Rows `slots` finished a token: their next query is the new token's depth-1 query at the next position."""
        self.e, self.x = self.e.index_copy(0, slots, e_new), self.x.index_copy(0, slots, e_new)
        self.q_pos = self.q_pos.index_add(0, slots, torch.ones_like(slots))
        self.q_stream = self.q_stream.index_fill(0, slots, 0)
        self.remaining = self.remaining.index_fill(0, slots, 1.0)
        self.log_mix = self.log_mix.index_fill(0, slots, float("-inf"))


def _emit_tokens(stopping: _Stopping, ids, log_q, alive: list[int], finish_slots: list[int], rows: _RowState,
                 do_sample: bool, done):
    """The next token of the rows of the pass at `finish_slots` (processors, then argmax or a draw), written to `ids`
    (batch rows `alive[slot]`); their stop flags (device, batch rows) and the host bookkeeping. `log_q` has one row
    per row of the pass. Returns (stop flags, the slots as a tensor, their tokens)."""
    device = ids.device
    P = stopping.prompt_len
    slot_of = {r: i for i, r in enumerate(alive)}
    new_slots, new_tokens = [], []
    for group, count in stopping.groups([alive[i] for i in finish_slots], rows.count):
        rows_t = torch.tensor(group, dtype=torch.long, device=device)
        slots_t = torch.tensor([slot_of[r] for r in group], dtype=torch.long, device=device)
        scores = stopping.scores(ids, rows_t, slots_t, count, log_q)
        tok = _pick(scores, do_sample)
        ids[rows_t, torch.tensor([P + rows.count[r] for r in group], dtype=torch.long, device=device)] = tok
        if not stopping.length_only:
            stop = stopping.done(ids, rows_t, count, tok, scores)
            done = done.index_put((rows_t,), done.index_select(0, rows_t) | stop)
        new_slots.append(slots_t)
        new_tokens.append(tok)
    for i in finish_slots:
        r = alive[i]
        rows.depths[r].append(rows.depth[r] + 1)
        rows.count[r] += 1
        rows.depth[r] = 0
    if len(new_slots) == 1:
        return done, new_slots[0], new_tokens[0]
    return done, torch.cat(new_slots), torch.cat(new_tokens)


def _pick(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    if do_sample:
        return torch.multinomial(F.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)


def _one_pass(model, kv: _StepKV, x, q_pos, q_stream, running):
    """One pass of the layer stack over one query per row, each at its own stream: h(m) (final-normed) and z(m)."""
    backbone = model.model
    kv.add_column(q_pos, q_stream, running)
    visible = kv.visibility(model.config.iteration_attention, q_pos, q_stream)
    mask = iteration_mask(visible, model.config, x.dtype)
    hidden = x[:, None]
    pos = q_pos[:, None]
    pos_emb = backbone.rotary_emb(hidden, pos)
    h = backbone.norm(backbone.run_layers(hidden, mask, pos, pos_emb, kv))[:, 0]
    return h, model.lm_head(h)


def _decide_and_mix(model, st: _Compact, h, z, M, tau, can_continue: list[int]) -> torch.Tensor:
    """Decider (continue iff g > τ, or sampled) and the stopping-weighted mixture update of every row of the pass (all
    compute), the same arithmetic as the lockstep loop's; updates `st.remaining` and `st.log_mix`. The decider runs
    only on `can_continue` (rows below depth M, a host list): a query at depth M stops anyway. Returns the continue
    flags."""
    cfg = model.config
    e, q_stream = st.e, st.q_stream
    last = q_stream >= M - 1
    n = e.shape[0]
    if len(can_continue) == n:
        logit = model._continue_logit(e, h, z)
    else:
        logit = torch.full((n,), float("-inf"), dtype=torch.float32, device=e.device)
        if can_continue:
            idx = torch.tensor(can_continue, dtype=torch.long, device=e.device)
            part = model._continue_logit(e.index_select(0, idx), h.index_select(0, idx), z.index_select(0, idx))
            logit = logit.index_copy(0, idx, part.float())
    g = torch.sigmoid(logit)
    if cfg.decision_mode == "sample":
        cont = torch.bernoulli(g).bool()
    else:
        cont = g > tau
    cont = cont & ~last
    g = torch.where(last, torch.zeros((), device=g.device), g)
    logp = torch.log_softmax(z.float(), dim=-1)
    remaining = st.remaining
    if cfg.mixture == "stop_prob":
        log_w = torch.log(torch.where(cont, remaining * (1.0 - g), remaining).clamp(min=1e-10))
        st.remaining = torch.where(cont, remaining * g, remaining)
    else:
        log_w = torch.zeros_like(remaining)
    term = logp.add_(log_w[:, None])
    st.log_mix = term if cfg.mixture == "final" else torch.logaddexp(st.log_mix, term)
    return cont


def _advance_depth(model, st: _Compact, cont_slots: list[int], h, z) -> None:
    """Continuing rows: the next depth's input U(e, h(m)) and stream."""
    x, e = st.x, st.e
    idx = torch.tensor(cont_slots, dtype=torch.long, device=x.device)
    logits = z.index_select(0, idx) if model.config.updater == "topk_embedding" else None
    x_next = model._next_input(e.index_select(0, idx), h.index_select(0, idx), logits)
    st.x = x.index_copy(0, idx, x_next.to(x.dtype))
    st.q_stream = st.q_stream.index_add(0, idx, torch.ones_like(idx))


class TaH2GenerationMixin(GenerationMixin):
    """`generate` for TaH2: greedy and multinomial sampling decode with continuous depth (one pass of the layer stack
    per step over mixed depths; same tokens and per-token depths as lockstep decoding).

    Lockstep (one pass per depth) is kept for everything the continuous-depth loop cannot express: beam search,
    assisted / prompt-lookup decoding and the other non-sampling modes (they use their own loops), `use_cache=False`,
    a cache passed by the caller, static or other non-dynamic caches, `return_dict_in_generate` (scores, attentions,
    hidden states, the returned cache), `synced_gpus`, a streamer with more than one row, logits processors that depend
    on a row's batch position (prefix constraints, classifier-free guidance, ...), M = 1, and the Huginn-style / Ouro
    exit-gate baselines. `generate(..., continuous_depth=False)` (or `model.continuous_depth_decoding = False`) forces
    lockstep, e.g. to compare the two.

    Rows decode at different speeds, so at a step only some rows finish a token, and rows hold different numbers of
    tokens. Logits processors and stopping criteria are called once per group of finishing rows of equal length, on the
    whole batch (every row in its place, ids cut at that length), and only the group's rows of the result are used:
    right for any processor that treats rows independently, as HF's own do (custom ones must too, or use
    `continuous_depth=False`). After a continuous-depth call, `model._last_decode_depths` holds per row the executed
    depth of every decoded input token (the lockstep path reports them through the returned cache). With
    `do_sample=True` (or `decision_mode="sample"`) at batch > 1 the random draws would differ from lockstep's, whose
    rows draw together (the distributions are the same; at batch 1 so are the draws), so such calls stay on lockstep
    unless `continuous_depth=True` asks for continuous depth: a seed then gives the same tokens with and without cache.
    """

    continuous_depth_decoding = True

    def generate(self, *args, continuous_depth: bool | None = None, **kwargs):
        if continuous_depth is not None and not isinstance(continuous_depth, bool):
            raise ValueError(f"continuous_depth must be True, False or None, got {continuous_depth!r}")
        previous = getattr(self, "_tah2_continuous_depth", None)
        self._tah2_continuous_depth = continuous_depth
        self._last_decode_mode = "lockstep"  # beam search and the other modes never reach `_sample`
        try:
            return super().generate(*args, **kwargs)
        finally:
            self._tah2_continuous_depth = previous

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        reason = continuous_depth_unsupported(self, generation_config, model_kwargs, logits_processor, streamer,
                                              synced_gpus, input_ids.shape[0], input_ids.shape[1])
        self._last_decode_mode = "lockstep" if reason else "continuous_depth"
        self._last_decode_depths = None
        if reason is not None:
            return super()._sample(input_ids, logits_processor, stopping_criteria, generation_config,
                                   synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
        return continuous_depth_sample(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                       streamer, model_kwargs)
