"""TaH2 save/load round trips and remote-code export."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.tah2_helpers import tiny_tah2
from transformers import AutoModelForCausalLM

from hf_loops import TaH2ForCausalLM
from hf_loops.conversion import export


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_round_trip(tmp_path, tied):
    model = tiny_tah2(max_iterations=3, qwen_overrides={"tie_word_embeddings": tied}, exit_threshold=0.4)
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["model_type"] == "tah2" and "auto_map" not in cfg
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, TaH2ForCausalLM)
    assert loaded.config.max_iterations == 3 and loaded.config.exit_threshold == 0.4
    assert torch.equal(_logits(model, ids), _logits(loaded, ids))


CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["hf_loops"] = None  # hf_loops cannot be imported in this process
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    path, ids_path, out_path = sys.argv[1:4]
    try:
        import hf_loops  # noqa: F401
        raise SystemExit("hf_loops was importable")
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    base = AutoModel.from_pretrained(path, trust_remote_code=True)
    assert type(base).__name__ == "TaH2Model"
    ids = torch.load(ids_path)
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.save({"logits": logits, "gen": gen}, out_path)
    """
)


@pytest.mark.slow
def test_export_loads_with_remote_code_without_hf_loops(tmp_path):
    model = tiny_tah2(max_iterations=2)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    out_dir = export(model, tmp_path / "exported")
    files = set(os.listdir(out_dir))
    assert {"config.json", "model.safetensors", "modeling_tah2.py", "configuration_tah2.py", "loop_utils.py"} <= files
    auto_map = json.load(open(os.path.join(out_dir, "config.json")))["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_tah2.TaH2Config",
        "AutoModel": "modeling_tah2.TaH2Model",
        "AutoModelForCausalLM": "modeling_tah2.TaH2ForCausalLM",
    }
    # Exporting does not make later plain saves remote-code saves.
    model.save_pretrained(tmp_path / "plain")
    assert "modeling_tah2.py" not in os.listdir(tmp_path / "plain")

    torch.save(ids, tmp_path / "ids.pt")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    res = subprocess.run([sys.executable, str(script), out_dir, str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    child = torch.load(tmp_path / "out.pt")
    assert (child["logits"] - _logits(model, ids)).abs().max() <= 1e-6  # thread counts may differ in the child
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(child["gen"], gen)


def test_export_refuses_non_empty_dir_and_leaves_nothing_on_failure(tmp_path):
    model = tiny_tah2(max_iterations=2)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        export(model, tmp_path / "busy")

    class Boom:
        def save_pretrained(self, path):
            raise RuntimeError("tokenizer failed")

    with pytest.raises(RuntimeError, match="tokenizer failed"):
        export(model, tmp_path / "out", tokenizer=Boom())
    assert not (tmp_path / "out").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".hf_loops_export_")] == []
