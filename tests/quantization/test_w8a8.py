"""`hf_loops.core.w8a8.save_w8a8_int8`: the compressed-tensors W8A8 int8 checkpoint vLLM's CPU build serves (served and
compared with the float model in tests/serving/test_vllm_tah2.py, `make test-vllm`). Here: what the files hold, by
hand; the policy (only the backbone's projections are int8); refusals and atomic output."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_loops.core import w8a8
from tests.helpers.looped_tiny_configs import tiny_causal_lm


def test_quantize_rows_by_hand():
    w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-254.0, 127.0, 1.0]])
    q, scale = w8a8.quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (3, 1)
    assert scale[0, 0] == pytest.approx(1 / 127) and scale[2, 0] == pytest.approx(2.0)
    assert q[0].tolist() == [127, -64, 32] and q[1].tolist() == [0, 0, 0] and q[2].tolist() == [-127, 64, 0]
    assert (q.float() * scale - w).abs().max() <= scale.max() / 2 + 1e-6  # round to nearest: within half a step


@pytest.mark.parametrize("arch", ["tah2_m2", "sgt"])
def test_checkpoint_holds_int8_projections_and_the_rest_unchanged(tmp_path, arch):
    model = tiny_causal_lm(arch, dtype=torch.float32)
    out = w8a8.save_w8a8_int8(model, str(tmp_path / "q"))
    tensors = load_file(f"{out}/model.safetensors")
    state = model.state_dict()
    projections = [n for n in state if w8a8.is_projection(n)]
    assert len(projections) == 7 * model.config.num_hidden_layers
    for name, t in state.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            assert name not in tensors
        elif name in projections:
            q, scale = tensors[name], tensors[name[: -len("weight")] + "weight_scale"]
            assert q.dtype == torch.int8 and scale.shape == (t.shape[0], 1) and scale.dtype == t.dtype
            assert (q.float() * scale - t).abs().max() <= scale.max() / 2 + 1e-6
        else:  # embeddings, norms, the LM head, the decider and updater: as they were
            assert torch.equal(tensors[name], t), name
    if arch == "tah2_m2":  # the loop's control stays float
        assert any(n.startswith("decider.") for n in tensors) and all(
            tensors[n].is_floating_point() for n in tensors if n.startswith(("decider.", "updater.")))
    with open(f"{out}/config.json") as f:
        config = json.load(f)
    assert config["quantization_config"] == w8a8.w8a8_quantization_config()
    assert config["model_type"] == model.config.model_type
    assert not [n for n in (tmp_path / "q").iterdir() if n.name.endswith(".index.json")]


def test_refusals_write_nothing(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match="model_type one of"):
        w8a8.save_w8a8_int8(qwen, str(tmp_path / "a"))
    model = tiny_causal_lm("tah2_m2", dtype=torch.float32)
    mlp = model.model.layers[0].mlp
    mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach().to(torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match="float weights"):
        w8a8.save_w8a8_int8(model, str(tmp_path / "b"))
    assert not list(tmp_path.iterdir())
