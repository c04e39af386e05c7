"""`hf-loops serve DIR`: transformers' own OpenAI-compatible server with our classes resolved through
`AutoModelForCausalLM`. A tiny exported model of each architecture is served on 127.0.0.1 (a free port); a chat
completion and a streamed one must give the tokens of greedy `generate` on the same chat prompt. Each is served by
`serve(..., non_blocking=True)` in this process; TaH2 also through the real command line (a child process).
Two concurrent requests get the same answers. `--continuous-batching` (tests/serving/test_continuous_batching.py) is
refused in one line for SpiralFormer; every request and the server's start are bounded by timeouts."""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers.common import tiny_qwen3
from helpers.conversion_helpers import tiny_tokenizer

pytest.importorskip("fastapi", reason="serving needs transformers' serving extras (pip install 'hf_loops[serve]')")
pytest.importorskip("uvicorn", reason="serving needs transformers' serving extras (pip install 'hf_loops[serve]')")

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
MESSAGES = [{"role": "user", "content": "Why loop a transformer?"}]
MAX_TOKENS = 8
ARCHS = {"tah2": {"max_iterations": 2}, "spiralformer": {}, "sgt": {}}


def exported(arch, folder):
    from hf_loops.conversion import convert_qwen3, export

    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    # eos id 96 is outside the tokenizer's 73 ids: generation runs the full MAX_TOKENS, so the comparison covers them
    model = convert_qwen3(tiny_qwen3(0, num_hidden_layers=4, eos_token_id=96), arch, **ARCHS[arch])
    export(model, folder, tokenizer=tok, model_card=False)
    return str(folder)


def greedy_text(folder):
    """What `generate` gives, greedy, on the chat prompt the server builds: (text, number of new tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    return tok.decode(new, skip_special_tokens=True), len(new)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(port, seconds, process=None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}: {process.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"the server on port {port} did not answer /health within {seconds} s")


def chat(port, stream):
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        text = r.read().decode()
    if not stream:
        answer = json.loads(text)
        return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]
    chunks = [json.loads(line[len("data: "):]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")), None


def check_answers(port, folder):
    want, n = greedy_text(folder)
    assert n == MAX_TOKENS and want
    text, completion_tokens = chat(port, stream=False)
    assert text == want and completion_tokens == n
    streamed, _ = chat(port, stream=True)
    assert streamed == want
    with ThreadPoolExecutor(2) as pool:  # two requests at once, one streamed: each still gets the greedy answer
        both = list(pool.map(lambda stream: chat(port, stream)[0], (False, True)))
    assert both == [want, want]


@pytest.mark.slow  # a child process that imports transformers' server stack: ~35 s on 2 busy cores
def test_tah2_served_by_the_command_line_answers_like_greedy_generate(tmp_path):
    folder = exported("tah2", tmp_path / "tah2")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "hf_loops.cli", "serve", folder, "--port", str(port),
                             "--device", "cpu"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(port, 180, proc)
        check_answers(port, folder)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.slow
def test_served_model_answers_like_greedy_generate(arch, tmp_path):
    from hf_loops.serving.http import add_arguments, serve

    folder = exported(arch, tmp_path / arch)
    port = free_port()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    server = serve(parser.parse_args([folder, "--port", str(port), "--device", "cpu"]), non_blocking=True)
    try:
        wait_until_healthy(port, 60)
        check_answers(port, folder)
    finally:
        server.kill_server()


def test_continuous_batching_is_refused_in_one_line_for_spiralformer(tmp_path, capsys):
    """SGT and TaH2 are served with --continuous-batching (tests/serving/test_continuous_batching.py)."""
    from hf_loops.cli import main

    folder = exported("spiralformer", tmp_path / "spiralformer")
    capsys.readouterr()  # the export's progress bars
    assert main(["serve", folder, "--continuous-batching", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--continuous-batching cannot serve spiralformer" in err[0]
    assert "serve without --continuous-batching" in err[0]


def test_a_directory_without_a_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    from hf_loops.cli import main

    assert main(["serve", str(tmp_path), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no config.json" in err[0]
