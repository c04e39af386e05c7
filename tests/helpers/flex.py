"""flex_attention without compilation, for tests of the masks we build.

On CPU, transformers compiles `flex_attention` and `create_block_mask`, and even torch's "uncompiled" `flex_attention`
traces each new shape with dynamo (~0.4 s a shape, more once dynamo's caches fill up over a whole test session). The
masks are what these tests check, so they run transformers' flex integration with torch's dense reference kernel of
the same op, called directly. The compiled kernel has tests of its own: TaH2's full forward in the suite, the rest
opt-in (HF_LOOPS_COMPILED_FLEX=1)."""

import os

import pytest

COMPILED_FLEX = pytest.mark.skipif(
    os.environ.get("HF_LOOPS_COMPILED_FLEX") != "1",
    reason="compiled flex_attention on CPU compiles a kernel per shape (minutes per module); set HF_LOOPS_COMPILED_FLEX=1")


def uncompiled_flex(monkeypatch, backward: bool = False) -> None:
    """Route transformers' flex path to torch's dense flex kernel and build block masks uncompiled. `backward=True`
    keeps torch's dynamo trace of the kernel, which its backward needs; otherwise the kernel is called directly."""
    import torch.nn.attention.flex_attention as torch_flex
    import transformers.integrations.flex_attention as hf_flex
    import transformers.masking_utils as masking

    def dense(query, key, value, training=False, **kwargs):
        return torch_flex.flex_attention(query, key, value, **kwargs)

    create = masking.create_block_mask
    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", dense)
    monkeypatch.setattr(masking, "create_block_mask", lambda *a, **k: create(*a, **{**k, "_compile": False}))
    if not backward:
        monkeypatch.setattr(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
