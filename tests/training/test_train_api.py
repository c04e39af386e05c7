"""The Python training API, `hf_loops.training.train_tah2.train`: typed values in, the same run as `hf-loops train`
(the CLI parses its words into the same call), unknown names refused with the closest valid one."""

import pytest
from helpers.train_cli_helpers import _argv, tiny_train_setup  # noqa: F401  (the `data` fixture)
from safetensors.torch import load_file

from hf_loops.training.train_tah2 import main as train_main
from hf_loops.training.train_tah2 import train


@pytest.mark.slow
def test_train_from_python_equals_the_command_line(data, tmp_path):
    assert train_main(_argv(data, tmp_path / "cli", "--max-iterations", "3")) == 0
    trainer = train(data["base"], data["train"], tmp_path / "api", "tah2", tokenizer=data["tokenizer"],
                    recipe="tiny-cpu", model={"max_iterations": 3, "exit_threshold": 0.05},
                    trainer={"max_steps": 2, "logging_steps": 1, "disable_tqdm": True})
    assert trainer.state.global_step == 2 and trainer.model.config.max_iterations == 3
    a, b = load_file(tmp_path / "cli" / "model.safetensors"), load_file(tmp_path / "api" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"tokenzier": "x"}, r"unknown option 'tokenzier'; did you mean 'tokenizer'\?"),
    ({"model": {"max_iteration": 3}}, r"unknown model field 'max_iteration'; did you mean 'max_iterations'\?"),
    ({"model": {"max_iterations": 0}}, r"max_iterations"),
    ({"trainer": {"learning_rate": float("inf")}}, r"learning_rate must be a finite number >= 0, got inf"),
])
def test_train_refuses_bad_names_and_values(data, tmp_path, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        train(data["base"], data["train"], tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
