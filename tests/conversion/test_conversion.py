"""Qwen3 → TaH2 / SpiralFormer / SGT conversion, export with remote code and a model card, push (mocked Hub)."""

import json
import os
import re
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
from helpers.conversion_helpers import CALIBRATION_TEXT, qwen3_dir, tiny_qwen3, tiny_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_loops import SGTForCausalLM, SpiralFormerForCausalLM
from hf_loops.cli import main
from hf_loops.conversion import convert_qwen3, export, push_to_hub
from hf_loops.conversion.report import conversion_report
from hf_loops.conversion.sgt import plan_from_entropy
from hf_loops.conversion.spiralformer import resolve_layer_map

IDS = torch.randint(4, 70, (2, 11), generator=torch.Generator().manual_seed(5))

# arch → extra CLI arguments (the calibration file is filled in by the fixture)
CLI_CASES = {
    "tah2": ["--set", "max_iterations=3", "--set", "exit_threshold=0.45"],
    "spiralformer": ["--set", "chunk_sizes=[2,1]", "--set", "topology=mesh"],
    "sgt": ["--set", "growth_max_layers=2", "--set", "growth_exclude_layers=[]", "--set", "heads_per_layer=2"],
}

CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["hf_loops"] = None  # hf_loops cannot be imported in this process
    import torch
    from transformers import AutoModelForCausalLM
    ids_path, out_path, *dirs = sys.argv[1:]
    try:
        import hf_loops  # noqa: F401
        raise SystemExit("hf_loops was importable")
    except ImportError:
        pass
    ids = torch.load(ids_path)
    out = {}
    for d in dirs:
        model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            out[d] = model(ids, use_cache=False).logits
    torch.save(out, out_path)
    """
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each architecture converted by the CLI from one random Qwen3 checkpoint directory: arch → (out dir, stdout)."""
    root = tmp_path_factory.mktemp("conv")
    src, _ = qwen3_dir(root / "qwen3", num_hidden_layers=4)
    calib = root / "calibration.txt"
    calib.write_text(CALIBRATION_TEXT)
    results = {}
    for arch, extra in CLI_CASES.items():
        if arch == "sgt":
            extra = extra + ["--calibration", str(calib)]
        out = root / f"out-{arch}"
        import io
        from contextlib import redirect_stdout

        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = main(["convert", src, "--arch", arch, "--out", str(out), *extra])
        assert rc == 0
        results[arch] = (str(out), buf.getvalue())
    return src, results


def _parity(stdout: str) -> float:
    m = re.search(r"1-loop parity \(.*\): max-abs-diff (\S+) over (\d+) prompts", stdout)
    assert m, stdout
    return float(m.group(1))


def test_cli_prints_parameters_parity_dtype_and_destination(converted):
    src, results = converted
    for arch, (out, stdout) in results.items():
        print(f"--- {arch}\n{stdout}")
        assert f"source: {src}" in stdout
        assert re.search(r"parameters: source [\d,]+ \| new [\d,]+ \| added [+-][\d,]+", stdout)
        assert "dtype: float32" in stdout and f"wrote {out}" in stdout
        assert _parity(stdout) < 1e-5, (arch, stdout)
    assert "added +0" in results["sgt"][1]  # SGT adds buffers only
    assert "loop plan:" in results["sgt"][1]


@pytest.mark.slow
def test_exports_load_with_the_package_and_with_remote_code_only(converted, tmp_path):
    _, results = converted
    dirs = [out for out, _ in results.values()]
    expected = {}
    for arch, (out, _) in results.items():
        cfg = json.load(open(os.path.join(out, "config.json")))
        assert cfg["model_type"] == arch and set(cfg["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
        files = set(os.listdir(out))
        assert {"model.safetensors", "generation_config.json", "README.md", "tokenizer.json",
                f"modeling_{arch}.py", f"configuration_{arch}.py"} <= files
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(model).__module__.startswith("hf_loops.")
        with torch.no_grad():
            expected[out] = model(IDS, use_cache=False).logits
    sgt_cfg = json.load(open(os.path.join(results["sgt"][0], "config.json")))
    assert len(sgt_cfg["loop_plan"]) == 2 and all(len(e["heads"]) == 2 for e in sgt_cfg["loop_plan"])

    torch.save(IDS, tmp_path / "ids.pt")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"), *dirs],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    child = torch.load(tmp_path / "out.pt")
    for d in dirs:
        assert torch.allclose(child[d], expected[d], atol=1e-6, rtol=0), d


def test_model_card_content(converted):
    src, results = converted
    arxiv = {"tah2": "2609.35748", "spiralformer": "2602.11698", "sgt": "2603.23998"}
    for arch, (out, stdout) in results.items():
        card = open(os.path.join(out, "README.md")).read()
        assert card.startswith("---\nlicense: apache-2.0\n")
        assert f"model_type: {arch}" in card and f"**Source checkpoint:** `{src}`" in card
        assert "## Configuration" in card and "| `hidden_size` | `32` |" in card
        assert re.search(r"\| source \| [\d,]+ \|", card) and "| added by the conversion |" in card
        assert f"{_parity(stdout):.3g}" in card
        assert "AutoModelForCausalLM.from_pretrained(" in card and "trust_remote_code=True" in card
        assert f"arXiv:{arxiv[arch]}" in card and "```bibtex" in card and "## Licence" in card


class FakeApi:
    """Records what would be uploaded; any other Hub call fails the test."""

    calls: list = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=False, exist_ok=False, repo_type=None, **kw):
        FakeApi.calls.append(("create_repo", repo_id, private, exist_ok))

    def upload_folder(self, repo_id, folder_path, commit_message=None, **kw):
        files = {}
        for root, _, names in os.walk(folder_path):
            for name in names:
                rel = os.path.relpath(os.path.join(root, name), folder_path)
                with open(os.path.join(root, name), "rb") as f:
                    files[rel] = f.read()
        FakeApi.calls.append(("upload_folder", repo_id, files, commit_message))
        return "commit-info"


@pytest.fixture
def fake_hub():
    FakeApi.calls = []
    with mock.patch("hf_loops.conversion.hub.HfApi", FakeApi):
        yield FakeApi.calls


def _check_upload(calls, repo, arch, private):
    assert [c[0] for c in calls] == ["create_repo", "upload_folder"]  # ONE commit
    assert calls[0][1:] == (repo, private, True)
    files = calls[1][2]
    assert {"model.safetensors", "config.json", "generation_config.json", f"modeling_{arch}.py",
            f"configuration_{arch}.py", "loop_utils.py", "tokenizer.json", "tokenizer_config.json",
            "README.md"} <= set(files)
    cfg = json.loads(files["config.json"])
    assert cfg["auto_map"]["AutoModelForCausalLM"].endswith("ForCausalLM")
    card = files["README.md"].decode()
    assert f'from_pretrained("{repo}", trust_remote_code=True)' in card and f"# {repo.split('/')[1]}" in card
    return card


def test_push_from_cli_is_one_commit(tmp_path, capsys, fake_hub):
    src, _ = qwen3_dir(tmp_path / "q")
    rc = main(["convert", src, "--arch", "tah2", "--out", str(tmp_path / "t"), "--push-to-hub", "me/tiny-tah2",
               "--private", "--license", "mit"])
    assert rc == 0, capsys.readouterr().err
    card = _check_upload(fake_hub, "me/tiny-tah2", "tah2", True)
    assert "license: mit" in card and "## Parity with the source" in card and "differ from the source" in card
    assert "pushed" in capsys.readouterr().out


def test_cli_dtype_and_layer_map(tmp_path, capsys):
    src, _ = qwen3_dir(tmp_path / "q", num_hidden_layers=4)
    assert main(["convert", src, "--arch", "tah2", "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "dtype: bfloat16" in out and _parity(out) < 1e-2  # fp32: exactly 0; bf16: kernel-order rounding only
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    rc = main(["convert", src, "--arch", "spiralformer", "--out", str(tmp_path / "sp"),
               "--layer-map", '{"pre": [0], "core": [1], "post": [3]}', "--set", "chunk_sizes=[2,1]"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "1-loop parity: n/a (layers were dropped" in out
    cfg = json.load(open(tmp_path / "sp" / "config.json"))
    assert (cfg["num_pre_layers"], cfg["num_loop_layers"], cfg["num_post_layers"]) == (1, 1, 1)
    assert cfg["conversion_layer_map"] == {"pre": [0], "core": [[1]], "post": [3]}
    assert "conversion_layer_map" in open(tmp_path / "sp" / "README.md").read()


def test_push_to_hub_function(tmp_path, fake_hub):
    q = tiny_qwen3(num_hidden_layers=4)
    model = convert_qwen3(q, "spiralformer", chunk_sizes=[1])
    report = conversion_report(q, model, source_name="Qwen/Qwen3-tiny")
    assert report["parity_max_abs_diff"] < 1e-5
    assert push_to_hub(model, "me/tiny-spiral", tokenizer=tiny_tokenizer(), source="Qwen/Qwen3-tiny",
                       report=report) == "commit-info"
    card = _check_upload(fake_hub, "me/tiny-spiral", "spiralformer", False)
    assert "base_model: Qwen/Qwen3-tiny" in card and "arXiv:2602.11698" in card
    assert f"{report['params']:,}" in card and f"{report['source_params']:,}" in card


# ----------------------------------------------------------------------------------------------------------------------
# SpiralFormer layer maps
# ----------------------------------------------------------------------------------------------------------------------


def test_spiralformer_layer_maps():
    assert resolve_layer_map(6) == {"pre": [0], "core": [[1], [2], [3], [4]], "post": [5]}
    assert resolve_layer_map(8, num_pre_layers=2, num_loop_layers=2, num_post_layers=2) == {
        "pre": [0, 1], "core": [[3], [4]], "post": [6, 7]}
    assert resolve_layer_map(8, num_pre_layers=2, num_loop_layers=2, num_post_layers=2, core_init="average") == {
        "pre": [0, 1], "core": [[2, 4], [3, 5]], "post": [6, 7]}
    q = tiny_qwen3(num_hidden_layers=6)
    model = convert_qwen3(q, "spiralformer", layer_map={"pre": [0], "core": [[1, 3], 2], "post": [5]},
                          chunk_sizes=[2, 1], topology="anchor")
    assert isinstance(model, SpiralFormerForCausalLM)
    c = model.config
    assert (c.num_pre_layers, c.num_loop_layers, c.num_post_layers, c.num_hidden_layers) == (1, 2, 1, 4)
    assert (c.core_output, c.router_init, c.depth_scaled_init) == ("delta", "identity", False)
    w = model.model.layers
    src = q.model.layers
    assert torch.equal(w[0].mlp.up_proj.weight, src[0].mlp.up_proj.weight)
    assert torch.allclose(w[1].mlp.up_proj.weight, (src[1].mlp.up_proj.weight + src[3].mlp.up_proj.weight) / 2)
    assert torch.equal(w[2].self_attn.q_proj.weight, src[2].self_attn.q_proj.weight)
    assert torch.equal(w[3].mlp.down_proj.weight, src[5].mlp.down_proj.weight)
    report = conversion_report(q, model)
    assert report["parity_max_abs_diff"] is None and "dropped" in report["parity_note"]
    assert report["added_params"] < 0  # two source layers dropped


@pytest.mark.parametrize("topology", ["anchor", "mesh"])
def test_spiralformer_keeping_every_layer_reproduces_the_source(topology):
    q = tiny_qwen3(num_hidden_layers=4, tie_word_embeddings=True)
    model = convert_qwen3(q, "spiralformer", chunk_sizes=[1], topology=topology)
    with torch.no_grad():
        diff = (model(IDS).logits - q(IDS).logits).abs().max().item()
    print("SPIRAL_PARITY", topology, diff)
    assert diff < 1e-5


# ----------------------------------------------------------------------------------------------------------------------
# SGT calibration
# ----------------------------------------------------------------------------------------------------------------------


def test_sgt_plan_is_deep_to_shallow_over_the_top_entropy_layers():
    from hf_loops import SGTConfig

    cfg = SGTConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, head_dim=8,
                    growth_top_layers=3, growth_max_layers=2, heads_per_layer=2, max_loop_depth=2,
                    growth_exclude_layers=[0])
    ent = torch.tensor([[0.99] * 4,  # excluded
                        [0.1, 0.2, 0.3, 0.4], [0.8, 0.1, 0.9, 0.7], [0.2] * 4,
                        [0.6, 0.65, 0.1, 0.9], [0.5, 0.1, 0.2, 0.95]])
    # mean: L1 .25, L2 .625, L3 .2, L4 .5625, L5 .4375 → Top = {2, 4, 5}; deepest first: 5, then 4 (budget 2)
    assert plan_from_entropy(ent, cfg) == [{"layer": 4, "heads": [1, 3], "depth": 2},
                                           {"layer": 5, "heads": [0, 3], "depth": 2}]


def test_sgt_calibration_measures_entropy_and_writes_the_plan(tmp_path):
    src, q = qwen3_dir(tmp_path / "q", num_hidden_layers=4)
    calib = tmp_path / "c.txt"
    calib.write_text(CALIBRATION_TEXT)
    model = convert_qwen3(src, "sgt", calibration=str(calib), growth_max_layers=2, growth_top_layers=2,
                          growth_exclude_layers=[])
    assert isinstance(model, SGTForCausalLM)
    ent = torch.tensor(model.config.calibration_entropy)
    assert ent.shape == (4, 4) and (ent > 0).all() and (ent <= 1).all()
    plan = model.config.loop_plan
    assert plan == plan_from_entropy(ent, model.config) and len(plan) == 2
    assert model.model.loop_structure() == plan
    with torch.no_grad():
        assert not torch.allclose(model(IDS).logits, q(IDS).logits)  # the loops change the output
    assert conversion_report(q, model)["parity_max_abs_diff"] == 0.0  # and switching them off restores it
    # a list of strings and an explicit tokenizer work too
    m2 = convert_qwen3(q, "sgt", calibration=[CALIBRATION_TEXT], tokenizer=tiny_tokenizer(), growth_max_layers=2,
                       growth_top_layers=2, growth_exclude_layers=[])
    assert m2.config.loop_plan == plan


# ----------------------------------------------------------------------------------------------------------------------
# Sources and errors
# ----------------------------------------------------------------------------------------------------------------------


def test_hub_id_source_uses_snapshot_download(tmp_path):
    src, q = qwen3_dir(tmp_path / "snap")
    with mock.patch("huggingface_hub.snapshot_download", return_value=src) as dl:
        model = convert_qwen3("Qwen/Qwen3-tiny", "tah2", max_iterations=1)
    assert dl.call_args.kwargs["repo_id"] == "Qwen/Qwen3-tiny"
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, q(IDS).logits)


def test_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ValueError, match="offline or unreachable"):
        convert_qwen3("nobody/not-a-model", "tah2")
    assert main(["convert", "nobody/not-a-model", "--arch", "sgt", "--out", str(tmp_path / "o")]) == 2
    assert "offline or unreachable" in capsys.readouterr().err and not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="is not a local directory"):
        convert_qwen3(str(tmp_path / "no" / "such" / "dir"), "tah2")


@pytest.mark.parametrize("arch", ["tah2", "spiralformer", "sgt"])
def test_non_qwen3_source_is_refused(tmp_path, arch, capsys):
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        convert_qwen3(llama, arch)
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="model_type 'llama'"):
        convert_qwen3(str(tmp_path / "llama"), arch)
    assert main(["convert", str(tmp_path / "llama"), "--arch", arch, "--out", str(tmp_path / "o")]) == 2
    assert "llama" in capsys.readouterr().err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("arch", ["tah2", "spiralformer", "sgt"])
def test_mismatched_shapes_and_missing_files(tmp_path, arch, capsys):
    src, _ = qwen3_dir(tmp_path / "q", tokenizer=False)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["intermediate_size"] = 48
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    with pytest.raises(ValueError, match="(?i)mismatch|size"):
        convert_qwen3(src, arch)
    assert main(["convert", src, "--arch", arch, "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()
    capsys.readouterr()
    # weights missing
    os.remove(os.path.join(src, "model.safetensors"))
    with pytest.raises(ValueError):
        convert_qwen3(src, arch)
    # config missing
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json is missing"):
        convert_qwen3(str(empty), arch)


def test_argument_errors(tmp_path):
    q = tiny_qwen3(num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"indices must be integers in \[0, 4\)"):
        convert_qwen3(q, "spiralformer", layer_map={"pre": [0], "core": [9], "post": [3]})
    with pytest.raises(ValueError, match="exceeds the source's 4 layers"):
        convert_qwen3(q, "spiralformer", num_pre_layers=2, num_loop_layers=2, num_post_layers=1)
    with pytest.raises(ValueError, match="spiralformer' only"):
        convert_qwen3(q, "tah2", layer_map={"core": [0]})
    with pytest.raises(ValueError, match="needs a tokenizer"):
        convert_qwen3(q, "sgt", calibration=[CALIBRATION_TEXT])
    with pytest.raises(ValueError, match="does not exist"):
        convert_qwen3(q, "sgt", calibration=str(tmp_path / "nope.txt"), tokenizer=tiny_tokenizer())
    with pytest.raises(ValueError, match="arch must be one of"):
        convert_qwen3(q, "ouro")


def test_export_is_atomic_and_refuses_non_empty_dirs(tmp_path):
    model = convert_qwen3(tiny_qwen3(), "sgt")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        export(model, tmp_path / "busy")
    with mock.patch("hf_loops.conversion.model_card.render_model_card", side_effect=RuntimeError("card failed")):
        with pytest.raises(RuntimeError, match="card failed"):
            export(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".hf_loops_export_")] == []
