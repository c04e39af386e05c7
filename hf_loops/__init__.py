"""hf_loops: looped transformers as Hugging Face `transformers` model plugins.

Importing the package checks the installed transformers against the supported range (`hf_loops.core.compat`), then
registers every architecture with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`.
"""

from .core.compat import check_transformers as _check_transformers

_check_transformers()

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

from .modeling.cache_tah2 import TaH2Cache  # noqa: E402
from .modeling.configuration_tah2 import TAH2_PRESETS, TaH2Config  # noqa: E402
from .modeling.modeling_tah2 import TaH2CausalLMOutput, TaH2ForCausalLM, TaH2Model, TaH2PreTrainedModel  # noqa: E402

__version__ = "0.1.0"


def _register(config_cls, base_cls, lm_cls) -> None:
    AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
    AutoModel.register(config_cls, base_cls, exist_ok=True)
    AutoModelForCausalLM.register(config_cls, lm_cls, exist_ok=True)


_register(TaH2Config, TaH2Model, TaH2ForCausalLM)

# --- other architectures register below (one block each) ---

from .modeling.configuration_spiralformer import SPIRALFORMER_PRESETS, SpiralFormerConfig  # noqa: E402
from .modeling.modeling_spiralformer import (  # noqa: E402
    SpiralFormerForCausalLM,
    SpiralFormerModel,
    SpiralFormerPreTrainedModel,
)

_register(SpiralFormerConfig, SpiralFormerModel, SpiralFormerForCausalLM)

from .modeling.configuration_sgt import SGTConfig  # noqa: E402
from .modeling.modeling_sgt import SGTForCausalLM, SGTModel, SGTPreTrainedModel  # noqa: E402

_register(SGTConfig, SGTModel, SGTForCausalLM)

__all__ = [
    "SPIRALFORMER_PRESETS",
    "SpiralFormerConfig",
    "SpiralFormerForCausalLM",
    "SpiralFormerModel",
    "SpiralFormerPreTrainedModel",
    "SGTConfig",
    "SGTForCausalLM",
    "SGTModel",
    "SGTPreTrainedModel",
    "TAH2_PRESETS",
    "TaH2Cache",
    "TaH2CausalLMOutput",
    "TaH2Config",
    "TaH2ForCausalLM",
    "TaH2Model",
    "TaH2PreTrainedModel",
]
