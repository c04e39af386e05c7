"""Token-budget batching (spec: tah2.md §9): packing within the budget, dropping over-long samples, the global batch
on any process count, the derived accumulation count, and TaH2's pooled δ_cut / β on such micro-batches."""

import random

import pytest
import torch
from datasets import Dataset
from helpers.conversion_helpers import tiny_tokenizer
from helpers.tah2_helpers import tiny_tah2

from hf_loops.training.tah2_trainer import TaH2SFTConfig, TaH2SFTTrainer, tah2_joint_loss
from hf_loops.training.token_budget import (
    TokenBudget,
    TokenBudgetBatchSampler,
    apply_token_budget,
    derived_accumulation,
    pack_micro_batches,
    pop_token_budget,
)


def _lengths(n=300, seed=0, high=120):
    rng = random.Random(seed)
    return [rng.randint(1, high) for _ in range(n)]


def _cost(batch, lengths, padded):
    ls = [lengths[i] for i in batch]
    return len(ls) * max(ls) if padded else sum(ls)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dp", [1, 2, 8])
def test_every_step_holds_the_global_batch_within_the_budget(padded, dp):
    lengths = _lengths()
    budget, G, max_len = 256, 32, 100
    samplers = [TokenBudgetBatchSampler(lengths, budget, G, max_length=max_len, dp_size=dp, rank=r, padded=padded,
                                        max_samples_per_batch=12, seed=3, num_epochs=2) for r in range(dp)]
    s0 = samplers[0]
    assert s0.dropped == sum(n > max_len for n in lengths)
    assert len(s0.kept) + s0.dropped == len(lengths)
    assert s0.steps_per_epoch == len(s0.kept) // G and len(s0) == s0.steps_per_epoch * s0.grad_accum
    for epoch in (0, 1, 2):  # epoch 2 reuses a planned shuffle
        seen = []
        for s in samplers:
            s.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        assert all(len(b) == len(s0) for b in per_rank)
        for step in range(s0.steps_per_epoch):
            step_samples = []
            for r in range(dp):
                mbs = per_rank[r][step * s0.grad_accum:(step + 1) * s0.grad_accum]
                assert all(1 <= len(mb) <= 12 and _cost(mb, lengths, padded) <= budget for mb in mbs)
                step_samples += [i for mb in mbs for i in mb]
            assert len(step_samples) == G  # the paper's global batch, whatever the process count
            seen += step_samples
        assert len(seen) == len(set(seen)) and all(lengths[i] <= max_len for i in seen)


def test_accumulation_is_derived_from_the_process_count():
    lengths = _lengths(600, seed=1)
    ga = {dp: TokenBudgetBatchSampler(lengths, 512, 64, max_length=120, dp_size=dp).grad_accum for dp in (1, 2, 4, 8)}
    assert ga[1] > ga[2] > ga[4] > ga[8] >= 1, ga
    # the paper's numbers: 128 samples of up to 16K tokens on 8 GPUs, budget 16,384
    paper = _lengths(1024, seed=2, high=16384)
    s = TokenBudgetBatchSampler(paper, 16384, 128, max_length=16384, dp_size=8, rank=5, max_samples_per_batch=32)
    assert s.dropped == 0 and all(_cost(mb, paper, False) <= 16384 for mb in s)
    assert derived_accumulation(128, 4, 8) == 4 and derived_accumulation(128, 4, 2) == 16
    assert derived_accumulation(128, 4, 3) == 11  # not divisible: the nearest global batch above (132)


def test_packing_is_first_fit_decreasing_and_checks_its_inputs():
    lengths = [50, 40, 30, 30, 20, 10]
    assert pack_micro_batches(range(6), lengths, 80) == [[0, 2], [1, 3, 5], [4]]
    assert pack_micro_batches(range(6), lengths, 100, padded=True) == [[0, 1], [2, 3, 4], [5]]
    with pytest.raises(ValueError, match="fewer than one global batch"):
        TokenBudgetBatchSampler([10, 500, 20], 100, 4)
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        TokenBudgetBatchSampler([10, 20], 0, 1)


def test_options_come_out_of_recipe_and_command_line():
    recipe = {"max_tokens_per_batch": 16384, "global_batch_size": 128, "learning_rate": 1e-5}
    rest = ["--max-tokens-per-batch", "4096", "--max_samples_per_batch=32", "--seed", "1"]
    budget = pop_token_budget(recipe, rest)
    assert budget == TokenBudget(4096, 128, 32) and recipe == {"learning_rate": 1e-5} and rest == ["--seed", "1"]
    assert pop_token_budget({"max_tokens_per_batch": None}, ["--max_tokens_per_batch", "none"]) is None
    with pytest.raises(ValueError, match="global_batch_size must be a positive integer"):
        pop_token_budget({"global_batch_size": "lots"}, [])


def _trainer(tmp_path, rows, **extra):
    tok = tiny_tokenizer()
    model = tiny_tah2(seed=0, max_iterations=2)
    args = TaH2SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", logging_steps=1,
                         save_strategy="no", learning_rate=1e-3, coverage=0.9, dataloader_num_workers=0, seed=0,
                         disable_tqdm=True, **extra)
    budget = TokenBudget(max_tokens_per_batch=40, global_batch_size=6)
    budget.detach_max_length(args)  # before the trainer: TRL must not truncate what the sampler drops
    trainer = TaH2SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    return trainer, budget


def _rows(n=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 16, (n,), generator=g).tolist() + [30, 31]  # the last two exceed max_length=24
    return [{"input_ids": torch.randint(4, 70, (n_,), generator=g).tolist()} for n_ in lengths]


def test_trainer_uses_the_budget_and_pools_delta_cut_and_beta_per_micro_batch(tmp_path, capsys):
    rows = _rows()
    trainer, budget = _trainer(tmp_path, rows, max_length=24, padding_free=True, max_steps=2)
    sampler = apply_token_budget(trainer, budget)
    err = capsys.readouterr().err
    assert "dropped 2 of 22 training samples longer than 24 tokens" in err
    assert f"gradient_accumulation_steps = {sampler.grad_accum}" in err
    assert trainer.args.gradient_accumulation_steps == sampler.grad_accum == trainer.accelerator.gradient_accumulation_steps
    assert trainer.args.max_length == 24 and len(trainer.train_dataset) == 22  # dropped by the sampler, not TRL
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == len(sampler)
    step0 = batches[:sampler.grad_accum]
    assert sum(int((b["position_ids"] == 0).sum()) for b in step0) == 6  # padding-free: one start per sample
    assert all(b["input_ids"].shape == (1, b["input_ids"].shape[1]) and b["input_ids"].shape[1] <= 40 for b in batches)

    # δ_cut / β of a packed micro-batch are pooled over all of its samples: the same as the padded batch of them
    model = trainer.model.eval()
    packed = max(step0, key=lambda b: int((b["position_ids"] == 0).sum()))
    starts = (packed["position_ids"][0] == 0).nonzero().flatten().tolist() + [packed["input_ids"].shape[1]]
    seqs = [packed["input_ids"][0, a:b].tolist() for a, b in zip(starts, starts[1:], strict=False)]
    assert len(seqs) >= 2
    width = max(map(len, seqs))
    padded = {"input_ids": torch.tensor([s + [0] * (width - len(s)) for s in seqs]),
              "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])}
    padded["labels"] = padded["input_ids"].masked_fill(padded["attention_mask"] == 0, -100)
    with torch.no_grad():
        _, _, m_packed = tah2_joint_loss(model, packed, trainer.args)
        _, _, m_padded = tah2_joint_loss(model, padded, trainer.args)
    for key in ("delta_cut@1", "beta@1", "label_continue_rate@1"):
        a, b = m_packed[key], m_padded[key]
        assert float(a[0]) == pytest.approx(float(b[0]), rel=1e-4, abs=1e-6), key
        assert float(a[1]) == pytest.approx(float(b[1])), key

    model.train()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 2 and len(logs) == 2 and "delta_cut@1" in logs[0] and "beta@1" in logs[0]


def test_global_batch_alone_derives_accumulation(tmp_path, capsys):
    trainer, _ = _trainer(tmp_path, _rows(8), per_device_train_batch_size=2, max_steps=1)
    apply_token_budget(trainer, TokenBudget(global_batch_size=8))
    assert trainer.args.gradient_accumulation_steps == 4
    assert "global batch 8 samples = 1 process(es) × 2 per device × gradient_accumulation_steps 4" in \
        capsys.readouterr().err


def test_paper_recipe_batches_by_token_budget(tmp_path):
    from hf_loops.training.train_tah2 import load_recipe, model_fields, trainer_config

    recipe = load_recipe("paper")
    for name in model_fields():  # the model's keys (max_iterations, …) are not trainer fields
        recipe.pop(name, None)
    rest = ["--use_cpu", "true", "--bf16", "false"]
    budget = pop_token_budget(recipe, rest)
    assert budget == TokenBudget(max_tokens_per_batch=16384, global_batch_size=128, max_samples_per_batch=32)
    assert "per_device_train_batch_size" not in recipe and "gradient_accumulation_steps" not in recipe
    config = trainer_config(recipe, rest, str(tmp_path), eval_dataset=False)
    assert config.max_length == 16384 and config.padding_free
    budget.detach_max_length(config)
    assert config.max_length is None and budget.max_length == 16384


@pytest.mark.slow
def test_train_command_takes_the_budget_options(tmp_path, capsys):
    import os

    from helpers.common import SHARED

    from hf_loops.training.train_tah2 import run

    tok_dir = os.path.join(SHARED, "data", "qwen3-tokenizer")
    gsm = os.path.join(SHARED, "data", "gsm8k", "gsm8k_test_100.jsonl")
    if not (os.path.isdir(tok_dir) and os.path.isfile(gsm)):
        pytest.skip("../shared/data is not present")
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    small = tmp_path / "gsm12.jsonl"  # 16 problems: the short ones make a global batch of 2
    with open(gsm) as f:
        small.write_text("".join(f.readlines()[:16]))
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(AutoTokenizer.from_pretrained(tok_dir)), hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)).save_pretrained(
        tmp_path / "base")
    trainer = run(["--base", str(tmp_path / "base"), "--tokenizer", tok_dir, "--arch", "tah2", "--dataset", str(small),
                   "--output-dir", str(tmp_path / "out"), "--recipe", "tiny-cpu", "--max_steps", "1",
                   "--max_length", "130", "--max-tokens-per-batch", "260", "--global_batch_size", "2",
                   "--padding_free", "true"])
    err = capsys.readouterr().err
    assert "token budget 260 tokens per micro-batch" in err and "longer than 130 tokens" in err
    assert trainer.state.global_step == 1 and trainer.args.gradient_accumulation_steps >= 1
