"""The tiny training setup shared by the `hf-loops train` tests: a byte-level BPE tokenizer (vocabulary ~300) with a
ChatML template, a tiny Qwen3 base, question/answer files, the common argv, and a child script that loads a
checkpoint by remote code with hf_loops blocked."""

import json
import textwrap

import pytest
import torch

# ChatML whose assistant content (with <|im_end|>) sits in {% generation %}: TRL builds assistant masks from it.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qa(i):
    return {"question": f"What is {i} plus {i + 3}? Think about it.", "answer": f"It is {2 * i + 3}."}


@pytest.fixture(scope="module", name="data")
def tiny_train_setup(tmp_path_factory):
    """A byte-level BPE tokenizer (vocabulary ~300) with a ChatML template, a tiny Qwen3 base and Q/A files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("train_cli")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        [json.dumps(_qa(i)) for i in range(20)],
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  chat_template=CHAT_TEMPLATE)
    tok.save_pretrained(root / "tok")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 tie_word_embeddings=True)).save_pretrained(root / "base")
    train, evals = root / "train.jsonl", root / "eval.jsonl"
    train.write_text("".join(json.dumps(_qa(i)) + "\n" for i in range(8)))
    evals.write_text("".join(json.dumps(_qa(i)) + "\n" for i in range(8, 11)))
    return {"root": root, "base": str(root / "base"), "tokenizer": str(root / "tok"), "train": str(train),
            "eval": str(evals), "tok": tok}


def _argv(data, out, *extra, arch="tah2"):
    # τ = 0.05: nearly every token continues, so every batch has tokens at depth 2 (the lookahead path).
    return ["--base", data["base"], "--tokenizer", data["tokenizer"], "--arch", arch, "--dataset", data["train"],
            "--output-dir", str(out), "--recipe", "tiny-cpu", "--max_steps", "2", "--logging_steps", "1",
            "--exit-threshold", "0.05", "--disable_tqdm", "true", *extra]


CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["hf_loops"] = None  # hf_loops cannot be imported in this process
    import torch
    from transformers import AutoModelForCausalLM
    try:
        import hf_loops  # noqa: F401
        raise SystemExit("hf_loops was importable")
    except ImportError:
        pass
    path, ids_path, out_path = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        torch.save(model(torch.load(ids_path)).logits, out_path)
    """
)
