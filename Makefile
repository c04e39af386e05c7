# One-command set-up: `make demo` runs the main job, `make test` runs the tests.
# Each target creates .venv and installs what it needs on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned so a CPU machine takes the CPU build that lies on local disk (a bare `torch` pulls a CUDA build).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install -e ".[train,dev,plot,serve]"
	touch $(STAMP)

install: $(STAMP)

# Post-trains the embedded base as Standard and TaH2, evaluates both on 20 held-out GSM8K problems, writes demo_out/.
demo: $(STAMP)
	$(BIN)/hf-loops demo --overwrite

# lm-evaluation-harness for its offline test (the test skips where the package cannot be installed).
EVAL_STAMP := $(VENV)/.installed-eval
$(EVAL_STAMP): $(STAMP)
	$(BIN)/pip install -e ".[eval]" || echo "lm-eval unavailable: its test will skip"
	touch $(EVAL_STAMP)

# transformers' own common model tests come from its sdist, cached outside the repository (a failed download prints
# one line; tests/modeling/test_transformers_common.py then skips).
test: $(STAMP) $(EVAL_STAMP)
	$(BIN)/python tests/fetch_transformers_tests.py
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check hf_loops tests

clean:
	rm -rf $(VENV) build dist *.egg-info
