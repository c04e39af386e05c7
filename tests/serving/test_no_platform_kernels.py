"""The vLLM models are built from vLLM's layer classes and its backends' own interfaces: no direct call of a CPU-only
kernel may come back into `hf_loops/serving/` (a source scan: runs in the plain suite, without vLLM)."""

import os
import re

SERVING = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "hf_loops", "serving")
# direct calls of platform kernels: vLLM's CPU attention cache writer, its CPU GEMM dispatch, the RMSNorm kernel
# wrapper, anything in torch.ops._C (vLLM's compiled kernels) and the CPU extension module
FORBIDDEN = re.compile(r"cpu_attn_|dispatch_cpu_unquantized_gemm|ops\.rms_norm|torch\.ops\._C\b|_C_cpu|"
                       r"_custom_ops|cpu_fused_moe|onednn_mm|_C\.")


def _code_lines(path):
    """The file's lines with comments removed (docstrings may name what is not called)."""
    for number, line in enumerate(open(path, encoding="utf-8"), 1):
        yield number, line.split("#", 1)[0]


def test_no_direct_cpu_kernel_calls_in_serving():
    files = [f for f in sorted(os.listdir(SERVING)) if f.endswith(".py")]
    assert "vllm_tah2.py" in files and "vllm_sgt.py" in files
    hits = [f"{name}:{number}: {line.strip()}" for name in files
            for number, line in _code_lines(os.path.join(SERVING, name)) if FORBIDDEN.search(line)]
    assert not hits, "direct platform-kernel calls in hf_loops/serving:\n" + "\n".join(hits)


def test_the_scan_sees_a_kernel_call():
    assert FORBIDDEN.search("ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)")
    assert FORBIDDEN.search("from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm")
    assert FORBIDDEN.search("ops.rms_norm(out, x, w, eps)")
    assert FORBIDDEN.search("torch.ops._C.cpu_attn_has_isa('vec')")
    assert FORBIDDEN.search("from vllm import _custom_ops as ops")
    assert not FORBIDDEN.search("attn.impl.do_kv_cache_update(attn, k, v, attn.kv_cache, slots)")
