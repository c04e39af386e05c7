"""transformers >= 5.25 serving: each model loads in a process of its own (spawned), with a pickled copy of the
server's `ModelLoader`. transformers' loader picks the class by name in the `transformers` module
(`config.architectures[0]`), which does not hold our classes; `LoopedModelLoader` loads our architectures through
`AutoModelForCausalLM` and leaves every other model to transformers.

It is a module of its own, imported only on those versions (its base class does not exist before 5.25), and the model
process finds the class here when it unpickles the loader: importing this module imports `hf_loops`, which registers
the architectures in that process too."""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cli.serving.model_manager import ModelLoader
from transformers.cli.serving.utils import parse_model_id

import hf_loops  # noqa: F401  (registers our classes with the Auto classes in the model's process)

from ..conversion.registry import ARCHITECTURES


class LoopedModelLoader(ModelLoader):
    def _load_model(self, model_id, tqdm_class=None, progress_callback=None):
        repo, revision, gguf_file = parse_model_id(model_id)
        config = AutoConfig.from_pretrained(repo, revision=revision, trust_remote_code=self.trust_remote_code)
        if config.model_type not in ARCHITECTURES or gguf_file is not None:
            return super()._load_model(model_id, tqdm_class, progress_callback)
        kwargs = {"revision": revision, "attn_implementation": self.attn_implementation, "dtype": self.dtype,
                  "device_map": self.device, "tqdm_class": tqdm_class}
        if self.get_quantization_config() is not None:
            kwargs["quantization_config"] = self.get_quantization_config()
        return AutoModelForCausalLM.from_pretrained(repo, **kwargs).eval()
