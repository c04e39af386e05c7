"""TRL's stock trainers on the three architectures: right answer or a one-line refusal, never a different model.

TRL 1.16's SFT, DPO and GRPO trainers compute log-probabilities through a fused LM head (`add_fused_lm_head`): the
backbone (`model.base_model`) once, then `lm_head`. SpiralFormer's and SGT's backbones are the whole model, so that is
their own loss. TaH2's depth loop lives in `TaH2ForCausalLM.forward`, so the fused path would train depth 1 only;
TaH2 refuses it with one line naming `TaH2SFTTrainer`. transformers' plain `Trainer` calls the model itself: the
mixture loss, with the updater and decider trained."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hf_loops import SGTConfig, SGTForCausalLM, SpiralFormerConfig, SpiralFormerForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.tah2_helpers import script_decider

from hf_loops.conversion import convert_qwen3

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = (REPO / ".." / "shared" / "data" / "qwen3-tokenizer").resolve()
needs_tokenizer = pytest.mark.skipif(not TOKENIZER.is_dir(), reason="shared/data/qwen3-tokenizer not available")
SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def half_continue(embeds, hidden=None):
    return torch.where(embeds[..., 0] > 0, 0.9, 0.1)


def tah2(tokenizer, M=2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    q = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), num_hidden_layers=2, pad_token_id=tokenizer.pad_token_id,
                                     **SMALL))
    model = convert_qwen3(q, "tah2", max_iterations=M)
    return script_decider(model, half_continue) if M > 1 else model


def spiral(tokenizer):
    torch.manual_seed(0)
    model = SpiralFormerForCausalLM(SpiralFormerConfig(
        vocab_size=len(tokenizer), num_hidden_layers=3, num_pre_layers=1, num_loop_layers=1, num_post_layers=1,
        chunk_sizes=[4, 2], topology="mesh", pad_token_id=tokenizer.pad_token_id, **SMALL))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("scorers", "allocators", "routers")):
                p.normal_(0.0, 0.5)
    return model


def sgt(tokenizer):
    torch.manual_seed(0)
    return SGTForCausalLM(SGTConfig(vocab_size=len(tokenizer), num_hidden_layers=3, pad_token_id=tokenizer.pad_token_id,
                                    loop_plan=[{"layer": 1, "heads": [0, 3], "depth": 2}], **SMALL))


def rows(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 150_000, (length,), generator=g).tolist() for length in (23, 17, 23, 11)[:n]]


def sft_trainer(model, tokenizer, tmp_path, **overrides):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_length=32, report_to=[],
                     use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, max_steps=2, learning_rate=1e-2,
                     **overrides)
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows()}),
                      processing_class=tokenizer)


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_one_line_refusal(err):
    message = str(err.value)
    assert "\n" not in message and "TaH2SFTTrainer" in message and "depth-1" in message, message


# ----------------------------------------------------------------------------------------------------------------------
# SFTTrainer
# ----------------------------------------------------------------------------------------------------------------------


@needs_tokenizer
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
@pytest.mark.slow
def test_stock_sft_trainer_refuses_a_looped_tah2_with_one_line_and_changes_nothing(tokenizer, tmp_path,
                                                                                    gradient_checkpointing):
    model = tah2(tokenizer, M=2)
    before = snapshot(model)
    trainer = sft_trainer(model, tokenizer, tmp_path, gradient_checkpointing=gradient_checkpointing)
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert_one_line_refusal(err)
    batch = next(iter(trainer.get_train_dataloader()))
    with pytest.raises(ValueError) as err:  # the trainer's own loss seam (used by eval and predict too)
        trainer.compute_loss(model, dict(batch))
    assert_one_line_refusal(err)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@needs_tokenizer
@pytest.mark.slow
def test_tah2sfttrainer_on_the_same_set_up_trains_updater_and_decider(tokenizer, tmp_path):
    from datasets import Dataset

    from hf_loops.training import TaH2SFTConfig, TaH2SFTTrainer

    model = tah2(tokenizer, M=2)
    model._continue_logit = type(model)._continue_logit.__get__(model)  # the real decider: it must train
    before = snapshot(model)
    args = TaH2SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_length=32, report_to=[],
                         use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, max_steps=2,
                         learning_rate=1e-2)
    trainer = TaH2SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows()}),
                             processing_class=tokenizer)
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any(n.startswith("updater.") for n in changed) and any(n.startswith("decider.") for n in changed)


@needs_tokenizer
def test_stock_sft_trainer_on_a_one_depth_tah2_is_its_own_loss(tokenizer, tmp_path):
    model = tah2(tokenizer, M=1)
    trainer = sft_trainer(model, tokenizer, tmp_path)
    batch = next(iter(trainer.get_train_dataloader()))
    assert (batch["attention_mask"] == 0).any()
    model.eval()
    with torch.no_grad():
        fused = trainer.compute_loss(model, dict(batch))
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                    use_cache=False).loss
    assert abs(fused.item() - own.item()) < 1e-5, (fused.item(), own.item())


@needs_tokenizer
@pytest.mark.parametrize("arch", ["spiralformer", "sgt"])
@pytest.mark.slow
def test_stock_sft_trainer_loss_is_the_models_own_loss(tokenizer, tmp_path, arch):
    model = {"spiralformer": spiral, "sgt": sgt}[arch](tokenizer)
    trainer = sft_trainer(model, tokenizer, tmp_path)
    batch = next(iter(trainer.get_train_dataloader()))
    assert (batch["attention_mask"] == 0).any()  # right-padded rows of different lengths
    model.train()
    fused = trainer.compute_loss(model, dict(batch))
    own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                use_cache=False).loss
    assert abs(fused.item() - own.item()) < 1e-5, (fused.item(), own.item())
    # and the gradients are the model's own: every parameter that the own loss reaches gets the same gradient
    fused.backward()
    g_fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    own.backward()
    g_own = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert g_fused.keys() == g_own.keys()
    for n in g_own:
        torch.testing.assert_close(g_fused[n], g_own[n], rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# transformers' plain Trainer: the model's own forward, so the mixture loss
# ----------------------------------------------------------------------------------------------------------------------


@needs_tokenizer
@pytest.mark.slow
def test_plain_transformers_trainer_trains_tah2_with_the_mixture_loss(tokenizer, tmp_path):
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    model = tah2(tokenizer, M=2)
    model._continue_logit = type(model)._continue_logit.__get__(model)  # the real decider: it must train
    data = Dataset.from_dict({"input_ids": rows()})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, max_steps=2, learning_rate=1e-2)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    loss = trainer.compute_loss(model, dict(batch))
    own = model(**batch).loss
    assert torch.allclose(loss, own)
    with torch.no_grad():
        depth1 = model(**batch, max_iterations=1).loss
    assert abs(loss.item() - depth1.item()) > 1e-4  # the mixture, not the depth-1 loss
    before = snapshot(model)
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any(n.startswith("updater.") for n in changed) and any(n.startswith("decider.") for n in changed)


# ----------------------------------------------------------------------------------------------------------------------
# DPO and GRPO: the same fused head, the same refusal for a looped TaH2
# ----------------------------------------------------------------------------------------------------------------------


@needs_tokenizer
@pytest.mark.slow
def test_stock_dpo_trainer_refuses_a_looped_tah2(tokenizer, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model = tah2(tokenizer, M=2)
    before = snapshot(model)
    data = Dataset.from_dict({"prompt": ["a b", "c d"], "chosen": [" e f", " g"], "rejected": [" h", " i j"]})
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[], use_cpu=True, bf16=False,
                     save_strategy="no", disable_tqdm=True, max_steps=1, max_length=16)
    trainer = DPOTrainer(model=model, ref_model=tah2(tokenizer, M=2), args=args, train_dataset=data,
                         processing_class=tokenizer)
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert_one_line_refusal(err)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@needs_tokenizer
@pytest.mark.slow
def test_stock_grpo_trainer_refuses_a_looped_tah2(tokenizer, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = tah2(tokenizer, M=2)
    before = snapshot(model)
    data = Dataset.from_dict({"prompt": ["a b", "c d"]})
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                      disable_tqdm=True, max_steps=1)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                          reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions])
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert_one_line_refusal(err)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
