"""A one-step TaH2 SFT run whose logged metrics can be compared across gradient accumulation and process counts.

The data is [A, B, A, B] in sequential order, so every micro-batch of two holds A and B: one process with batch 4,
one process with batch 2 × 2 accumulation steps and two processes with batch 2 all see the same tokens, and (the
cut-off is pooled per micro-batch over ranks, spec §4.3) the same labels. Run directly or under `accelerate launch`.
"""

import json
import os
import sys

import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from hf_loops.conversion import convert_qwen3
from hf_loops.training.tah2_trainer import TaH2SFTConfig, TaH2SFTTrainer

SHARED_TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "..",
                                "shared", "data", "qwen3-tokenizer")


def rows(tok):
    a = tok("Question: 12 apples and 7 pears. Answer: 19 fruits in all.").input_ids
    b = tok("Q: 3*4? A: 12").input_ids
    out = []
    for ids in (a, b):
        prompt = len(ids) // 3
        out.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * (len(ids) - prompt)})
    return out


def build_trainer(out_dir, per_device, accumulation, **extra):
    tok = AutoTokenizer.from_pretrained(SHARED_TOKENIZER)
    tok.pad_token = tok.pad_token or tok.eos_token
    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    model = convert_qwen3(qwen, "tah2", max_iterations=2, exit_threshold=0.5)
    with torch.no_grad():  # decisions far from τ: the same tokens take the same routes in any batch layout
        torch.manual_seed(1)
        model.decider.score.weight.normal_(0.0, 3.0)
    a, b = rows(tok)
    args = TaH2SFTConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", max_steps=1, logging_steps=1,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation, learning_rate=0.0,
        train_sampling_strategy="sequential", save_strategy="no", coverage=0.9, completion_only_loss=True,
        dataloader_num_workers=0, seed=0, **extra)
    return TaH2SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([a, b, a, b]), processing_class=tok)


def logged(trainer):
    trainer.train()
    return next(h for h in trainer.state.log_history if "ntp_loss" in h)


if __name__ == "__main__":
    out_json, per_device, accumulation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    trainer = build_trainer(os.path.dirname(out_json), per_device, accumulation)
    logs = logged(trainer)
    if trainer.accelerator.is_main_process:
        with open(out_json, "w") as f:
            json.dump({**logs, "world": trainer.accelerator.num_processes}, f)
