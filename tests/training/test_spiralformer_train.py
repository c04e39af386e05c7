"""SpiralFormer training: TRL's fused LM head computes the model's own loss; short pretraining runs lower the loss."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hf_loops import SpiralFormerConfig, SpiralFormerForCausalLM

REPO = Path(__file__).resolve().parents[2]
DATA = (REPO / ".." / "shared" / "data").resolve()
needs_data = pytest.mark.skipif(
    not (DATA / "corpus").is_dir() or not (DATA / "qwen3-tokenizer").is_dir(), reason="shared/data not available"
)


def _load_example():
    path = REPO / "examples" / "pretrain_spiralformer.py"
    spec = importlib.util.spec_from_file_location("pretrain_spiralformer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_data
@pytest.mark.parametrize("topology", ["mesh", "anchor"])
@pytest.mark.slow
def test_trl_fused_lm_head_loss_equals_own_forward(tmp_path, topology):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(DATA / "qwen3-tokenizer")
    config = SpiralFormerConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_hidden_layers=3, num_pre_layers=1, num_loop_layers=1,
        num_post_layers=1, chunk_sizes=[4, 2, 1], topology=topology, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = SpiralFormerForCausalLM(config)
    with torch.no_grad():  # switch the (zero-initialised) learned scalings on so every path matters
        for name, p in model.named_parameters():
            if "scorers" in name or "allocators" in name:
                p.normal_(0.0, 0.5)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 150_000, (n,), generator=g).tolist() for n in (23, 17, 23, 11)]  # ragged → right padding
    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_length=32, report_to=[], use_cpu=True,
        bf16=False, gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows}),
                         processing_class=tokenizer)
    inputs = next(iter(trainer.get_train_dataloader()))
    assert (inputs["attention_mask"] == 0).any()  # the batch really is padded
    model.eval()
    with torch.no_grad():
        fused = trainer.compute_loss(model, dict(inputs))
        own = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=inputs["labels"],
                    use_cache=False).loss
    assert abs(fused.item() - own.item()) < 1e-5, (fused.item(), own.item())
    print("FUSED", topology, fused.item(), own.item())


@needs_data
@pytest.mark.slow
def test_short_pretraining_lowers_the_loss(tmp_path):
    example = _load_example()
    results = {}
    for preset in ("spiral-b", "looped"):
        results[preset] = example.main(
            [
                "--preset", preset, "--compact-vocab", "--max-steps", "30", "--max-chars", "20000",
                "--seq-len", "32", "--batch-size", "8", "--hidden-size", "32", "--loop-layers", "1",
                "--eval-blocks", "8", "--logging-steps", "10", "--no-save",
                "--corpus", "../shared/data/corpus", "--output-dir", str(tmp_path / preset),
            ]
        )
    for preset, r in results.items():
        # at initialisation the held-out loss is that of a uniform predictor; 30 steps must clearly beat it
        assert abs(r["heldout_loss_start"] - r["uniform_loss"]) < 0.1, (preset, r)
        assert r["heldout_loss_end"] < r["heldout_loss_start"] - 0.4, (preset, r)
        assert r["train_losses"][-1] < r["train_losses"][0]
    assert results["spiral-b"]["chunk_sizes"] == [8, 4, 2, 1] and results["looped"]["chunk_sizes"] == [1, 1]
