"""TEMPORARY STUB — being replaced by the real TaH2 implementation (in progress)."""
from transformers import PreTrainedModel
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.cache_utils import DynamicCache
from .configuration_tah2 import TaH2Config


class TaH2Cache(DynamicCache):
    pass


class TaH2CausalLMOutput(CausalLMOutputWithPast):
    pass


class TaH2PreTrainedModel(PreTrainedModel):
    config_class = TaH2Config


class TaH2Model(TaH2PreTrainedModel):
    pass


class TaH2ForCausalLM(TaH2PreTrainedModel, GenerationMixin):
    pass
