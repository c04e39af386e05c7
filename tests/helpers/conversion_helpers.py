"""Shared builders for the conversion tests: tiny Qwen3 checkpoints, a tiny in-process tokenizer, the official TaH2
layout written by the test itself."""

import json
import os

import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from helpers.common import tiny_qwen3, tiny_qwen3_config  # noqa: F401  (re-exported for the tests)

CALIBRATION_TEXT = (
    "Looped transformers think harder on hard tokens. The quick brown fox jumps over the lazy dog. "
    "A model that repeats its layers can spend more compute where the next token is uncertain. "
) * 4


def tiny_tokenizer():
    """Character-level tokenizer (73 ids < the tiny models' 97): pad 0, eos 1, bos 2 like `tiny_qwen3_config`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for ch in " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-":
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def qwen3_dir(path, seed=0, tokenizer=True, **overrides):
    """A tiny random Qwen3 checkpoint directory (with tokenizer files); returns (path, model)."""
    q = tiny_qwen3(seed, **overrides)
    q.save_pretrained(path)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return str(path), q


def chat_base(path, chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}"):
    """A tiny tied-embedding Qwen3 directory whose tokenizer has a (minimal) chat template, as `train`/`eval` need;
    returns (path, tokenizer)."""
    base, _ = qwen3_dir(path, tie_word_embeddings=True)
    tok = tiny_tokenizer()
    tok.chat_template = chat_template
    tok.save_pretrained(base)
    return base, tok


class Qwen3MLPIterDecider:
    """Stands in for the authors' class object: pickled by reference, so `weights_only=True` refuses the file."""


def write_official_tah2(path, tah2_model, decider_class="Qwen3MLPIterDecider", updater_class="Qwen3MLPUpdater",
                        threshold=None, decider_class_obj=None, mixture="stop_prob_mix", extra_init_args=None):
    """Write `tah2_model` in the authors' layout: plain Qwen3 config + weights, tah_config.json, two .bin dicts."""
    from transformers import Qwen3Config

    cfg = tah2_model.config
    own = set(type(cfg).__annotations__)
    fields = {k: v for k, v in cfg.to_dict().items()
              if k not in own and k not in ("model_type", "architectures", "transformers_version", "dtype")}
    qcfg = Qwen3Config(**fields)
    q = Qwen3ForCausalLM(qcfg)
    state = {k: v for k, v in tah2_model.state_dict().items() if not k.startswith(("updater.", "decider."))}
    q.load_state_dict(state, strict=not qcfg.tie_word_embeddings)
    if qcfg.tie_word_embeddings:
        q.tie_weights()
    q.save_pretrained(path)
    tah = {
        "embedding_key": "model.embed_tokens", "max_iter": cfg.max_iterations,
        "iter_attention_mode": cfg.iteration_attention, "attn_implementation": "sdpa", "iter_attention_impl": "sdpa",
        "weighted_hidden_method": mixture, "memory_lean_fp32_reductions": True,
        "iter_decider": decider_class, "iter_decider_kwargs": {}, "eval_iter_decider": None,
        "input_updater": updater_class, "input_updater_kwargs": {},
        "train_loss": {"__type__": "tah.model.loss.TaHLoss"}, "dtype": {"__dtype__": "torch.float32"},
    }
    with open(os.path.join(path, "tah_config.json"), "w") as f:
        json.dump(tah, f)
    tau = cfg.exit_threshold if threshold is None else threshold
    dec_state = {}
    if tah2_model.decider is not None:
        dec_state = {k: v.clone() for k, v in tah2_model.decider.state_dict().items()}
    dec_state["threshold"] = torch.tensor(tau, dtype=torch.float32)
    dec_args = {"hidden_size": cfg.hidden_size, "uniform_init": False, **(extra_init_args or {})}
    torch.save({"class": decider_class_obj or decider_class, "init_args": dec_args, "state_dict": dec_state},
               os.path.join(path, "iter_decider.bin"))
    upd_state = {k: v.clone() for k, v in tah2_model.updater.state_dict().items()} if tah2_model.updater else {}
    upd_args = {"enable_norm_pre_mlp": cfg.updater_norm_pre_mlp, "enable_norm_out": cfg.updater_norm_out}
    torch.save({"class": updater_class, "init_args": upd_args, "state_dict": upd_state},
               os.path.join(path, "input_updater.bin"))
    tiny_tokenizer().save_pretrained(path)
    return str(path)
