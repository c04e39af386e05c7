#!/usr/bin/env bash
# Every row of the benchmark suite on a GPU, in bf16, on a Qwen3-1.7B-shaped model (random weights, no downloads):
#
#     bash bench/gpu.sh [more `python -m bench` options, e.g. --rows tah2-kv,spiral-core]
#
# Writes bench/results/cuda.json and bench/results/cuda.md and prints the table. Meant to finish within about
# 8 minutes (each torch.compile row is cut at 120 s and reported as such). Attention: flash_attention_2 where the
# flash-attn package is installed, else sdpa; a row that fails under flash is measured again with sdpa and says so.
# Needs a python with torch (CUDA build) and transformers 5.x; hf_loops is imported from this checkout, not installed.
# Not yet run: no GPU was lent when it was written.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python}"
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    PY=.venv/bin/python
fi
"$PY" - <<'EOF'
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
EOF

# Every attention backend against eager first (bench/gpu_check.py; writes bench/results/cuda-attention*.json):
# float32 must match to 1e-4, bfloat16 to 3e-2 on log-probs; a mismatch is reported and the benchmark still runs.
"$PY" -m bench.gpu_check --device cuda --dtype float32 || echo "attention check (float32) reported mismatches"
"$PY" -m bench.gpu_check --device cuda --dtype bfloat16 || echo "attention check reported mismatches"

"$PY" -m bench all --device cuda --dtype bfloat16 "$@"

# The vLLM serving rows (bench/vllm_serving.py, TaH2 against vLLM's Qwen3, depth scheduling on and off) where a
# Python with vLLM's CUDA build and hf_loops installed is named by VLLM_PYTHON (writes
# bench/results/cuda-vllm-serving*.{json,md}). Not yet run: no GPU was lent when it was written.
if [ -n "${VLLM_PYTHON:-}" ] && "$VLLM_PYTHON" -c "import vllm" 2>/dev/null; then
    "$VLLM_PYTHON" bench/vllm_serving.py --sizes 100m --batches 1,8,32 --rounds 3 || echo "vLLM rows failed"
    mkdir -p bench/results/in-step
    HF_LOOPS_VLLM_DEPTH_SCHEDULING=0 "$VLLM_PYTHON" bench/vllm_serving.py --sizes 100m --batches 1,8,32 --rounds 3 \
        --out bench/results/in-step || echo "vLLM rows (in-step depths) failed"
fi
