"""SpiralFormer FLOPs against the paper's Table 1 (spec: spiralformer.md §9, §13): Pythia shapes, sequence 4096,
SpiralFormer-B† {1/8, 1/4, 1/2, 1} vs the LoopedFormer† {1, 1} of the same split."""

import pytest

from hf_loops.core import flops_spiralformer as fs

# SpiralFormer-B† / LoopedFormer† prefill FLOPs in Table 1: 1.48/1.65, 4.11/4.59, 8.95/9.67, 12.92/14.08
PAPER_RATIOS = {"160M": 0.897, "410M": 0.895, "1B": 0.926, "1.4B": 0.918}


@pytest.mark.parametrize("size", list(PAPER_RATIOS))
def test_table1_spiral_b_over_looped_ratio_to_three_digits(size):
    ratio = fs.table1_ratios()[size]
    paper = fs.TABLE1_PAPER_FLOPS[size]
    assert ratio == pytest.approx(PAPER_RATIOS[size], abs=1e-3)
    assert ratio == pytest.approx(paper[2] / paper[1], abs=1e-3)  # the unrounded ratio of the table's FLOPs


@pytest.mark.parametrize("size", list(PAPER_RATIOS))
def test_table1_absolute_flops_within_one_percent(size):
    ours = fs.table1_flops(size)
    pythia, looped, spiral_b, spiral_l = fs.TABLE1_PAPER_FLOPS[size]
    for name, paper in (("pythia", pythia), ("looped", looped), ("spiral_b", spiral_b), ("spiral_l", spiral_l)):
        assert ours[name] == pytest.approx(paper, rel=0.01), (name, ours[name], paper)
    # SpiralFormer-L (matched parameters, no full-resolution iteration) vs the Pythia baseline: 3-10% cheaper
    assert ours["spiral_l"] / ours["pythia"] == pytest.approx(spiral_l / pythia, abs=5e-3)


def test_gelu_mlp_has_two_matrices_and_looped_baseline_is_two_passes():
    swiglu = fs.pythia_shape("410M", mlp="swiglu", softmax_flops=0.0)
    gelu = fs.pythia_shape("410M", mlp="gelu", softmax_flops=0.0)
    d, n = 1024, 128
    assert fs.layer_flops(n, gelu) == pytest.approx(fs.layer_flops_mha(n, d))  # 2n(4d² + 2·d·4d) + 4n²d
    assert fs.layer_flops(n, swiglu) - fs.layer_flops(n, gelu) == pytest.approx(2 * n * d * 4 * d)
    with pytest.raises(ValueError, match="mlp"):
        fs.pythia_shape("410M", mlp="relu")
    cmp = fs.compare_to_looped(gelu, 4096)
    assert cmp["looped_1_1_flops"] == fs.looped_forward_flops(gelu, 4096, iterations=2)
    assert cmp["looped_T_flops"] == fs.looped_forward_flops(gelu, 4096)  # four full passes
    # {1,1} is the fair baseline: cheaper than T = 4 full passes, so the ratio against it is the larger one
    assert cmp["ratio_vs_looped_T"] < cmp["ratio_vs_looped_1_1"] < 1.0
    # the core's linear part of four passes vs Σ r = 1.875
    lin = fs.layer_flops(4096, gelu, 0.0)
    assert fs.resolution_factors([8, 4, 2, 1])[0] * lin < 2 * lin


def _example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "pretrain_spiralformer.py"
    spec = importlib.util.spec_from_file_location("pretrain_spiralformer_recipes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pretrain_example_paper_recipe_scales_sequence_and_batch(tmp_path):
    ex = _example()
    args = ex.parse_args(["--recipe", "paper", "--scale", "0.125", "--output-dir", str(tmp_path)])
    assert (args.seq_len, args.batch_size, args.micro_batch_size, args.grad_accum) == (512, 64, 8, 8)
    assert (args.lr, args.warmup_ratio, args.min_lr_rate, args.adam_beta2, args.weight_decay) == \
        (6e-4, 0.01, 0.1, 0.95, 0.01)
    full = ex.parse_args(["--recipe", "paper"])
    assert (full.seq_len, full.batch_size) == (4096, 512)
    cfg = ex.sft_config(args)
    assert str(getattr(cfg.lr_scheduler_type, "value", cfg.lr_scheduler_type)) == "cosine_with_min_lr"
    assert cfg.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and cfg.warmup_steps == 0.01
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.weight_decay) == (0.9, 0.95, 0.01)
    assert cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps == 64
    assert cfg.bf16 == ex.use_bf16("bf16-if-supported")  # bf16 on a bf16 GPU, fp32 on CPU
    # explicit options win over the recipe
    over = ex.parse_args(["--recipe", "paper", "--seq-len", "1024", "--lr", "1e-3", "--schedule", "constant"])
    assert (over.seq_len, over.lr, over.schedule) == (1024, 1e-3, "constant")


def test_pretrain_example_defaults_are_long_enough_and_short_sequences_warn():
    ex = _example()
    args = ex.parse_args([])
    assert args.recipe == "cpu" and args.seq_len >= 512 and args.schedule == "cosine" and args.warmup_ratio == 0.01
    for preset in ("spiral-b", "spiral-l"):
        assert ex.short_sequence_warning(args.seq_len, ex.PRESETS[preset]) is None
    warning = ex.short_sequence_warning(64, ex.PRESETS["spiral-b"])
    assert "only 8 latents" in warning and "--seq-len 256" in warning
    assert ex.short_sequence_warning(64, ex.PRESETS["looped"]) is None  # full resolution only
