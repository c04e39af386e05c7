"""TaH2 (adaptive looped Qwen3) as a vLLM model, for vLLM's CPU backend, eager mode.

How one engine step runs (vLLM hands over one flat list of N tokens that mixes prefill chunks and decode tokens):

* Depth 1 runs every token through the backbone with vLLM's own `Attention` layers (slot (0, l): stream 0).
* The decider picks the tokens that continue, across the whole flat batch; the updater builds their inputs; only
  they run the shared weights again, at depth m, writing their K/V into slot (m−1, l) at their own position (the
  same block table as stream 0: vLLM reserves M·L KV slots per token).
* A per-slot marker (`executed depth` of the token that occupies a KV slot) says which deeper entries exist, so a
  depth-m query sees exactly the set its `iteration_attention` mode allows (duo: every earlier token's states of
  depth ≤ m that were executed; causal: earlier tokens' depth 1 and its own earlier depths; same_iter: depth m
  only). A deeper pass plans once per step (`DeepPlan`: per request the key slots, the mask, the flat cache offsets)
  and every layer gathers those keys/values from the paged caches and runs a masked sdpa (no paged kernel takes
  the mask).
* `forward` keeps the per-depth log-probabilities of the rows vLLM samples (the decider's LM head output reused) and
  returns, per token, its hidden states of every depth, the log-weights of the stopping-weighted mixture and its row
  index; `compute_logits` returns the mixture's log-probabilities log q of the sampled rows, which vLLM samples.

Only the TaH2 configuration and its updater/decider modules are imported from hf_loops (they import under the
transformers version vLLM pins); the backbone is written here with Qwen3's weight names, on vLLM's CPU kernels as
vLLM's own Qwen3 (fused q/k/v and gate/up projections on its GEMM, its rotary and RMSNorm kernels).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from hf_loops.modeling.configuration_tah2 import TaH2Config
from hf_loops.modeling.modeling_tah2 import TaH2Decider, TaH2Updater
from hf_loops.serving import vllm_stats

__all__ = ["TaH2Config", "TaH2ForCausalLMvLLM", "check_servable"]


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


def check_engine(vllm_config, name: str) -> None:
    """Refuse the engine settings the looped models are not built for (one line each)."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError(f"{name} in vLLM: only tensor_parallel_size=1 and pipeline_parallel_size=1 are supported")
    if vllm_config.cache_config.cache_dtype != "auto":
        raise ValueError(f"{name} in vLLM: kv_cache_dtype must be 'auto', got {vllm_config.cache_config.cache_dtype!r}")


# ----------------------------------------------------------------------------------------------------------------------
# Reading the CPU backend's paged KV cache
# ----------------------------------------------------------------------------------------------------------------------


class PagedLayout:
    """Where the CPU backend's cache writer puts key/value element (token offset o, kv head h, dim d) inside one
    block of a `(num_blocks, H, block_size, 2·D)` cache tensor. Learned once by writing probe values with the
    backend's own writer (its layout depends on the instruction set: keys are stored transposed for `vec`), so the
    deeper passes can write and read any slot with one flat scatter / gather per cache (keys and values together)."""

    def __init__(self, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, isa: str):
        from vllm import _custom_ops as ops

        if max(block_size, head_dim, num_kv_heads) > 256:
            raise ValueError("TaH2 in vLLM: block_size, head_dim and num_kv_heads must be <= 256 (cache layout probe)")
        self.ops, self.isa, self.block_size = ops, isa, block_size
        H, bs, D = num_kv_heads, block_size, head_dim
        coords = torch.stack(torch.meshgrid(torch.arange(bs), torch.arange(H), torch.arange(D), indexing="ij"))
        slots = torch.arange(bs)
        index = []
        for which in (0, 1):  # 0: keys, 1: values
            seen = []
            for c in coords:  # encode the token offset, the head, the dim in turn (exact small integers)
                cache = torch.zeros(1, H, bs, 2 * D, dtype=dtype)
                probe = (c + 1).to(dtype)
                zero = torch.zeros_like(probe)
                self._write(cache, probe if which == 0 else zero, probe if which == 1 else zero, slots)
                seen.append(cache.view(-1).float().round().long() - 1)
            o, h, d = seen
            hit = o >= 0
            flat = torch.full((bs, H, D), -1, dtype=torch.long)
            flat[o[hit], h[hit], d[hit]] = hit.nonzero().squeeze(1)
            if int(hit.sum()) != bs * H * D or bool((flat < 0).any()):
                raise ValueError(f"TaH2 in vLLM: unsupported KV cache layout for isa {isa!r} (probe not a bijection)")
            index.append(flat)
        # (bs, 2, H, D): flat offsets inside one block of the key (0) and value (1) of every (token offset, head, dim)
        self.kv_index = torch.stack(index, dim=1)

    def _write(self, cache, key, value, slots):
        nb, H, bs, _ = cache.shape
        kc, vc = cache.view(nb, H, 2 * bs, -1).chunk(2, dim=2)
        self.ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, self.isa)

    def flat_offsets(self, slots: torch.Tensor, block_numel: int) -> torch.Tensor:
        """(n,) slots → (n, 2, H, D) offsets into the flattened cache of their keys and values: the same for every
        cache of the model (all have one shape), so a step computes them once and every (layer, stream) reuses them."""
        block, offset = slots // self.block_size, slots % self.block_size
        return (block * block_numel)[:, None, None, None] + self.kv_index[offset]

    @staticmethod
    def write(cache, offsets: torch.Tensor, key, value) -> None:
        """key, value: (n, H, D) into the slots whose `flat_offsets` are given."""
        cache.view(-1)[offsets.view(-1)] = torch.stack([key, value], dim=1).reshape(-1).to(cache.dtype)

    @staticmethod
    def read(cache, offsets: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The (n, 2, H, D) keys and values at `flat_offsets`, flattened (into `out` when given)."""
        return torch.index_select(cache.view(-1), 0, offsets.view(-1), out=out)


# ----------------------------------------------------------------------------------------------------------------------
# One deeper pass: which keys every continuing token sees
# ----------------------------------------------------------------------------------------------------------------------


class DeepPlan:
    """For the tokens that run stream j ≥ 1 in this step: per request, its queries and the key slots of positions
    0..max query position in every visible stream, with the visibility mask, and where in the paged caches those keys
    and values and the new ones live. Built once per (step, depth) and shared by all L layers."""

    def __init__(self, mode: str, stream: int, tokens: torch.Tensor, positions: torch.Tensor, meta, marker,
                 layout: PagedLayout, block_numel: int):
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
        key_pos = torch.arange(P, device=device)
        table = meta.block_table.index_select(0, req_ids)
        block_size = layout.block_size
        self.key_slots = (table.gather(1, (key_pos // block_size).expand(G, P)) * block_size
                          + key_pos % block_size)  # (G, P)
        depth = marker[self.key_slots].long()  # executed depth of the token in each key slot
        qp = q_pos[self.q_slot][:, :, None]  # (G, n, 1)
        kp = key_pos.view(1, 1, P)
        earlier = (kp <= qp) & (kp < meta.seq_lens.index_select(0, req_ids).view(G, 1, 1).to(device))
        self.own_position = (kp == qp)[:, None]  # (G, 1, n, P)
        masks = []
        for s in self.streams:
            exists = depth[:, None, :] > s
            if mode == "causal" and s > 0:
                masks.append(earlier & exists & (kp == qp))
            else:
                masks.append(earlier & exists)
        self.mask = torch.cat(masks, dim=-1)[:, None]  # (G, 1, n, S·P)
        # flat offsets of the keys/values read (G·P slots) and of the new ones written (the tokens' own slots)
        self.read_offsets = layout.flat_offsets(self.key_slots.reshape(-1), block_numel)
        self.write_offsets = layout.flat_offsets(meta.slot_mapping[tokens], block_numel)


# ----------------------------------------------------------------------------------------------------------------------
# The Qwen3 backbone on flat tokens
# ----------------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm (fp32 statistics, the same `weight`) on vLLM's CPU kernel: one call instead of seven ops."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        from vllm import _custom_ops as ops

        x = x.contiguous()
        out = torch.empty_like(x)
        ops.rms_norm(out, x, self.weight, self.eps)
        return out


class Linear(nn.Linear):
    """`nn.Linear` whose matmul, once `use_cpu_gemm` has run after the weights are loaded, is vLLM's CPU GEMM (oneDNN
    on a packed weight, as vLLM's own linear layers). Decode batch 8, same process, interleaved, single thread: 100m
    (hidden 1024 × 8 layers) 3083 → 2036 ms for 15 steps against torch's GEMM, the small bench model 303 → 274 ms."""

    def forward(self, x):
        gemm = self.__dict__.get("cpu_linear")
        if gemm is None:
            return F.linear(x, self.weight, self.bias)
        return gemm(x.contiguous(), self.weight, self.bias)


def use_cpu_gemm(model: nn.Module, keep_weight=frozenset()) -> None:
    """Pack every `Linear` of `model` for vLLM's CPU GEMM, dropping the unpacked weight (one copy in memory) except
    where it is still read: tied to an embedding, or a module in `keep_weight`."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if isinstance(module, Linear):
            keep = id(module.weight) in embeddings or module in keep_weight
            dispatch_cpu_unquantized_gemm(module, remove_weight=not keep)


def use_kernel_layers(module: nn.Module) -> None:
    """Swap every transformers RMSNorm and `nn.Linear` inside `module` (TaH2's updater and decider, built from our HF
    modeling) for `RMSNorm` and `Linear`, keeping their parameters (so their checkpoint names)."""
    for name, child in list(module.named_children()):
        if type(child).__name__ == "Qwen3RMSNorm":
            norm = RMSNorm(child.weight.shape[0], child.variance_epsilon)
            norm.weight = child.weight
            setattr(module, name, norm)
        elif type(child) is nn.Linear:
            linear = Linear(child.in_features, child.out_features, bias=child.bias is not None)
            linear.weight, linear.bias = child.weight, child.bias
            setattr(module, name, linear)
        else:
            use_kernel_layers(child)


class _FusedLinear(Linear):
    """Several of the checkpoint's projections of one input stacked along the output (Qwen3's q/k/v, gate/up): one
    matmul instead of several, as vLLM's own Qwen3 runs them; `load_checkpoint_weights` fills the shards by name."""

    def __init__(self, d_in: int, shards: dict[str, int], bias: bool):
        super().__init__(d_in, sum(shards.values()), bias=bias)
        self.shards = shards  # checkpoint projection name → output rows, in order


class _MLP(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.d_ff = d_ff
        self.gate_up_proj = _FusedLinear(d, {"gate_proj": d_ff, "up_proj": d_ff}, bias=False)
        self.down_proj = Linear(d_ff, d, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.d_ff, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _Qwen3Attention(nn.Module):
    """Qwen3's attention projections (q/k/v fused), q/k norms and rotary embedding (vLLM's kernel) with one vLLM
    `Attention` (one paged KV slot) per name in `slots` (the first is `{prefix}.attn`); TaH2 and SGT subclass it and
    differ in how they use the slots."""

    def __init__(self, config, cache_config, prefix: str, slots: list[str]):
        super().__init__()
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.layers.rotary_embedding import get_rope

        self.H, self.Hkv = config.num_attention_heads, config.num_key_value_heads
        self.D = getattr(config, "head_dim", None) or config.hidden_size // self.H
        d, bias = config.hidden_size, config.attention_bias
        self.scaling = self.D ** -0.5
        self.sizes = [self.H * self.D, self.Hkv * self.D, self.Hkv * self.D]
        self.qkv_proj = _FusedLinear(d, dict(zip(("q_proj", "k_proj", "v_proj"), self.sizes, strict=True)), bias)
        self.o_proj = Linear(self.H * self.D, d, bias=bias)
        self.q_norm = RMSNorm(self.D, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.D, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(self.D, max_position=config.max_position_embeddings,
                                   rope_parameters=config.rope_parameters)
        self.attn = nn.ModuleList(
            Attention(self.H, self.D, self.scaling, num_kv_heads=self.Hkv, cache_config=cache_config,
                      prefix=f"{prefix}.{name}")
            for name in ["attn", *slots])

    def _qkv(self, x, positions):
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.q_norm(q.reshape(n, self.H, self.D)).reshape(n, -1)
        k = self.k_norm(k.reshape(n, self.Hkv, self.D)).reshape(n, -1)
        q, k = self.rotary_emb(positions, q, k)  # in place on the CPU backend
        return q.view(n, self.H, self.D), k.view(n, self.Hkv, self.D), v.reshape(n, self.Hkv, self.D)


def load_checkpoint_weights(model: nn.Module, weights, arch: str, skip=lambda name: False) -> set[str]:
    """Copy a checkpoint's tensors into `model`'s parameters by name (tied lm_head and `skip(name)` left out; a
    projection the backbone fuses goes into its shard of the fused parameter); an unknown name is refused, and so is
    a fused parameter the checkpoint fills only in part. vLLM's attention layers' own scale parameters are not
    checkpoint weights (vLLM initialises them), so they count as loaded."""
    params = dict(model.named_parameters())
    shards, missing = {}, {}  # checkpoint name → (fused parameter name, row offset, rows); fused name → shards left
    for path, module in model.named_modules():
        if isinstance(module, _FusedLinear):
            parent = path.rsplit(".", 1)[0]
            for kind in ("weight", "bias") if module.bias is not None else ("weight",):
                offset = 0
                for shard, rows in module.shards.items():
                    shards[f"{parent}.{shard}.{kind}"] = (f"{path}.{kind}", offset, rows)
                    offset += rows
                missing[f"{path}.{kind}"] = len(module.shards)
    loaded = set()
    for name, tensor in weights:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name in shards:
            fused, offset, rows = shards[name]
            target = params[fused].narrow(0, offset, rows)
            missing[fused] -= 1
        elif name in params:
            target, fused = params[name], name
        elif skip(name):
            continue
        else:
            raise ValueError(f"{arch} in vLLM: unexpected weight {name!r} in the checkpoint")
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        loaded.add(fused)
    incomplete = sorted(name for name, left in missing.items() if left and name in loaded)
    if incomplete:
        raise ValueError(f"{arch} in vLLM: the checkpoint fills only part of {incomplete[0]!r}")
    loaded.update(name for name in params if ".attn" in name.rsplit(".self_attn.", 1)[-1])
    return loaded


class _SelfAttention(_Qwen3Attention):
    def __init__(self, config, layer_idx: int, cache_config, prefix: str):
        # one paged KV slot per (stream, layer); all share the block table of stream 0
        super().__init__(config, cache_config, prefix, [f"attn_depth{j + 1}" for j in range(1, config.max_iterations)])

    def forward(self, x, positions, stream: int, plan: DeepPlan | None):
        q, k, v = self._qkv(x, positions)
        n = x.shape[0]
        if stream == 0:
            out = self.attn[0](q.reshape(n, -1).contiguous(), k.reshape(n, -1).contiguous(),
                               v.reshape(n, -1).contiguous())
            return self.o_proj(out)
        return self.o_proj(self._deep_attention(q, k, v, stream, plan))

    def _deep_attention(self, q, k, v, stream, plan):
        n = q.shape[0]
        if plan is None:  # profiling / warm-up run: no cache bound yet
            return torch.zeros(n, self.H * self.D, dtype=q.dtype, device=q.device)
        PagedLayout.write(self.attn[stream].kv_cache, plan.write_offsets, k, v)
        G, P = plan.key_slots.shape
        S = len(plan.streams)
        kv = torch.empty(S, G * P * 2 * self.Hkv * self.D, dtype=self.attn[0].kv_cache.dtype, device=q.device)
        for i, s in enumerate(plan.streams):  # one gather per visible stream: its keys and values together
            PagedLayout.read(self.attn[s].kv_cache, plan.read_offsets, out=kv[i])
        kv = kv.view(S, G, P, 2, self.Hkv, self.D).permute(3, 1, 4, 0, 2, 5).to(q.dtype)  # (2, G, Hkv, S, P, D)
        K, V = kv.reshape(2, G, self.Hkv, S * P, self.D).unbind(0)
        Q = q[:, None] if plan.single_query else q[plan.q_slot]  # (G, n_max, H, D)
        out = F.scaled_dot_product_attention(Q.transpose(1, 2), K, V, attn_mask=plan.mask, scale=self.scaling,
                                             enable_gqa=self.H != self.Hkv).transpose(1, 2)
        out = out[:, 0] if plan.single_query else out[plan.q_real]  # (n, H, D) in token order
        return out.reshape(n, self.H * self.D)


class _DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, cache_config, prefix):
        super().__init__()
        self.self_attn = _SelfAttention(config, layer_idx, cache_config, f"{prefix}.self_attn")
        self.mlp = _MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, positions, stream, plan):
        x = x + self.self_attn(self.input_layernorm(x), positions, stream, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, config, cache_config, prefix):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_DecoderLayer(config, i, cache_config, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def run(self, x, positions, stream, plan):
        for layer in self.layers:
            x = layer(x, positions, stream, plan)
        return self.norm(x)


# ----------------------------------------------------------------------------------------------------------------------
# The model vLLM runs
# ----------------------------------------------------------------------------------------------------------------------


class _Runtime:
    """What the deeper passes share within one step: the cache layout and the executed-depth marker per slot."""

    layout: PagedLayout | None = None
    marker: torch.Tensor | None = None
    block_size: int = 0
    block_numel: int = 0  # elements of one cache block (every (stream, layer) cache has the same shape)


class TaH2ForCausalLMvLLM(nn.Module):
    """vLLM model class for `TaH2ForCausalLM` checkpoints (eager mode, tensor parallel size 1)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_servable(config)
        check_engine(vllm_config, "TaH2")
        self.config = config
        self.M = config.max_iterations
        self.model = _Backbone(config, vllm_config.cache_config, "model" if not prefix else f"{prefix}.model")
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.updater = TaH2Updater(config) if config.updater == "learned" and self.M > 1 else None
        self.decider = TaH2Decider(config) if config.decider == "learned" and self.M > 1 else None
        for module in (self.updater, self.decider):
            if module is not None:
                use_kernel_layers(module)
        self.runtime = _Runtime()
        self.runtime.block_size = vllm_config.cache_config.block_size
        self.dtype = vllm_config.model_config.dtype
        # tokens run at each depth since the last reset (real steps only): mean depth and continue rates
        self.depth_counts = torch.zeros(self.M, dtype=torch.long)
        # engine steps that ran depth m (each such step runs the backbone once more: all weights read again)
        self.step_counts = [0] * self.M
        # per request, returned with the finished request by the depth-statistics connector (when it is configured)
        self.request_statistics = vllm_stats.enabled(vllm_config)
        self._runner = None
        self._sampled = None  # (row → position, log q) of the rows this step's forward prepared for sampling

    # -- vLLM's interface ----------------------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        e = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        meta = self._step_metadata()
        h = self.model.run(e, positions, 0, None)
        N, d, M = e.shape[0], e.shape[1], self.M
        hidden = torch.zeros(N, M, d, dtype=torch.float32, device=e.device)
        log_w = torch.full((N, M), float("-inf"), dtype=torch.float32, device=e.device)
        depth = torch.ones(N, dtype=torch.long, device=e.device)
        real = N
        sampled = None
        if meta is not None:
            real = meta.num_actual_tokens  # the rest is padding: it never runs deeper
            self.runtime.marker[meta.slot_mapping[:real]] = 1
            self.depth_counts[0] += real
            self.step_counts[0] += 1
            sampled = self._SampledRows(meta, N, M, self.config.vocab_size, e.device)
        tokens = torch.arange(N, device=e.device)
        remaining = torch.ones(N, dtype=torch.float32, device=e.device)  # R = Π g of earlier depths
        for m in range(1, M + 1):
            hidden[tokens, m - 1] = h.float()
            z = None
            if m == M:
                cont = torch.zeros(tokens.shape[0], dtype=torch.bool, device=e.device)
                g = torch.zeros(tokens.shape[0], device=e.device)
            else:
                z = self.lm_head(h) if self._needs_logits() else None
                g = torch.sigmoid(self._continue_logit(e[tokens], h, z))
                cont = torch.bernoulli(g).bool() if self.config.decision_mode == "sample" else g > self.config.exit_threshold
            if sampled is not None:  # this depth's log-probabilities of the rows vLLM samples (z reused if computed)
                sampled.add(m, tokens, h, z, self.lm_head)
            r = remaining[tokens]
            log_w[tokens, m - 1] = torch.log(torch.where(cont, r * (1.0 - g), r).clamp(min=1e-10))
            remaining[tokens] = torch.where(cont, r * g, r)
            keep = (cont & (tokens < real)).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            x = self._next_input(e[tokens[keep]], h[keep], None if z is None else z[keep])
            tokens = tokens[keep]
            depth[tokens] = m + 1
            plan = None
            if meta is not None:
                self.runtime.marker[meta.slot_mapping[tokens]] = m + 1
                self.depth_counts[m] += tokens.numel()
                self.step_counts[m] += 1
                plan = DeepPlan(self.config.iteration_attention, m, tokens, positions, meta, self.runtime.marker,
                                self.runtime.layout, self.runtime.block_numel)
            h = self.model.run(x, positions[tokens], m, plan)
        if meta is not None and self.request_statistics:
            if self._runner is None:
                self._runner = vllm_stats.current_runner()
            vllm_stats.record(self._runner, meta, positions, depth, M)
        log_w = self._mixture_weights(log_w, depth)
        self._sampled = None if sampled is None else sampled.mixture(log_w)
        rows = torch.arange(N, device=e.device, dtype=torch.float32)[:, None]  # each row's index (exact in fp32)
        return torch.cat([hidden.flatten(1), log_w, rows], dim=1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Mixture log-probabilities log q = logsumexp_m (log ω(m) + log_softmax(z(m))) of the sampled rows: taken from
        this step's forward for the rows it prepared (each request's last token: what vLLM samples), otherwise
        computed from the per-depth hidden states the row carries (e.g. prompt log-probabilities)."""
        if self._sampled is not None:
            row_pos, log_q = self._sampled
            rows = hidden_states[:, -1].long()
            if rows.numel() and int(rows.min()) >= 0 and int(rows.max()) < row_pos.numel():
                pos = row_pos[rows]
                if int(pos.min()) >= 0:
                    return log_q[pos]
        n, M, d = hidden_states.shape[0], self.M, self.config.hidden_size
        h = hidden_states[:, : M * d].reshape(n * M, d).to(self.model.embed_tokens.weight.dtype)
        log_w = hidden_states[:, M * d: M * d + M].float()
        logp = torch.log_softmax(self.lm_head(h).float(), dim=-1).view(n, M, -1)
        return torch.logsumexp(log_w[..., None] + logp, dim=1)

    class _SampledRows:
        """The rows vLLM will sample in this step (each request's last scheduled token) and their per-depth
        log-probabilities, kept as the depths run, so the LM head runs once per executed depth of a sampled row
        (reusing the decider's logits) instead of again for every depth in `compute_logits`."""

        def __init__(self, meta, N: int, M: int, vocab: int, device):
            self.rows = (meta.query_start_loc[1:].to(device) - 1).long()
            self.row_pos = torch.full((N,), -1, dtype=torch.long, device=device)
            self.row_pos[self.rows] = torch.arange(self.rows.numel(), device=device)
            self.depths = []  # per executed depth: (positions among the sampled rows, log-softmax of their logits)

        def add(self, m: int, tokens, h, z, lm_head) -> None:
            pos = self.row_pos[tokens]
            sel = (pos >= 0).nonzero().squeeze(1)
            if sel.numel():
                z_sel = z[sel] if z is not None else lm_head(h[sel])
                self.depths.append((m, pos[sel], torch.log_softmax(z_sel.float(), dim=-1)))

        def mixture(self, log_w):
            """log q = logsumexp over executed depths of log ω + log p, one depth at a time (every sampled row ran
            depth 1, the deeper depths a subset)."""
            w = log_w[self.rows]
            (_, _, log_q), *deeper = self.depths
            log_q = log_q + w[:, :1]
            for m, pos, logp in deeper:
                log_q[pos] = torch.logaddexp(log_q[pos], logp + w[pos, m - 1: m])
            return self.row_pos, log_q

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # a depth-1 checkpoint may carry an updater and decider this model has no use for
        loaded = load_checkpoint_weights(self, weights, "TaH2",
                                         skip=lambda name: self.M == 1 and name.startswith(("updater.", "decider.")))
        use_cpu_gemm(self)
        return loaded

    def depth_statistics(self, reset: bool = False) -> dict:
        """Tokens run at each depth since the last reset, their mean executed depth, the continue rate after each
        depth, and the engine steps that ran each depth (read in-process with `LLM.apply_model(lambda m:
        m.depth_statistics())`)."""
        counts = self.depth_counts.tolist()
        stats = {"tokens_per_depth": counts,
                 "mean_depth": sum(counts) / counts[0] if counts[0] else 0.0,
                 "continue_rate": [b / a if a else 0.0 for a, b in zip(counts, counts[1:], strict=False)],
                 "steps_per_depth": list(self.step_counts)}
        if reset:
            self.depth_counts.zero_()
            self.step_counts = [0] * self.M
        return stats

    # -- the pieces ------------------------------------------------------------------------------------------------------
    def _step_metadata(self):
        """This step's attention metadata (None in profiling runs); binds the cache layout and marker on first use."""
        from vllm.model_executor.layers.attention.attention import get_attention_context

        attn0 = self.model.layers[0].self_attn.attn[0]
        meta, layer, cache, _ = get_attention_context(attn0.layer_name)
        if meta is None or cache.numel() == 0:
            return None
        rt = self.runtime
        if rt.marker is None or rt.marker.numel() != cache.shape[0] * cache.shape[2]:
            if not cache.is_contiguous():
                raise ValueError("TaH2 in vLLM: the deeper passes need contiguous KV cache tensors")
            rt.block_size, rt.block_numel = cache.shape[2], cache[0].numel()
            rt.layout = PagedLayout(cache.shape[1], cache.shape[2], cache.shape[3] // 2, cache.dtype, layer.isa)
            rt.marker = torch.zeros(cache.shape[0] * cache.shape[2], dtype=torch.int8, device=cache.device)
        return meta

    def _needs_logits(self) -> bool:
        return self.config.decider == "learned" or self.config.updater == "topk_embedding"

    def _continue_logit(self, e, h, z):
        kind = self.config.decider
        if kind == "learned":
            return self.decider(e, h, z)
        return torch.full((e.shape[0],), float("inf") if kind == "always" else float("-inf"), device=e.device)

    def _next_input(self, e, h, z):
        kind = self.config.updater
        if kind == "learned":
            return self.updater(e, h)
        if kind == "identity":
            return e
        if kind == "hidden":
            return h
        k = min(self.config.updater_topk, z.shape[-1])
        top = z.float().topk(k, dim=-1)
        weights = torch.softmax(top.values, dim=-1).to(e.dtype)
        return torch.einsum("nk,nkd->nd", weights, self.model.embed_tokens.weight[top.indices])

    def _mixture_weights(self, log_w, depth):
        """log ω per executed depth (−inf where not executed) for the configured mixture."""
        kind = self.config.mixture
        executed = torch.arange(self.M, device=depth.device)[None] < depth[:, None]
        if kind == "stop_prob":
            return log_w.masked_fill(~executed, float("-inf"))
        if kind == "even":
            return torch.where(executed, -torch.log(depth.float())[:, None], float("-inf"))
        last = torch.arange(self.M, device=depth.device)[None] == (depth[:, None] - 1)
        return torch.where(last, 0.0, float("-inf"))



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
