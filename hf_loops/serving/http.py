"""`hf-loops serve DIR`: an OpenAI-compatible HTTP server (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health`; streaming included) for a looped checkpoint, through transformers' own `transformers serve` machinery
(FastAPI + uvicorn).

transformers' model manager (from 5.25: its model loader, `model_loader.py`) picks the model class by name in the
`transformers` module (`config.architectures[0]`), which does not hold our classes; here the manager resolves our architectures through `AutoModelForCausalLM` (where
`import hf_loops` registered them) and leaves every other model to transformers. Nothing else is changed.

Continuous batching (`--continuous-batching`): transformers' paged-attention manager batches the requests of SGT and
TaH2 (every depth and loop gets its own paged cache slots: the models present them to the manager as extra layers,
see `LoopedContinuousBatchingMixin` in hf_loops/modeling/loop_utils.py); SpiralFormer and the TaH2 variants the paged
cache cannot hold (Huginn-style core loop, Ouro exit gate, sampled decisions) are refused at start in one line.
Without it, each request runs the model's own `generate` with its own cache."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..core.compat import serve_loads_models_in_their_own_process
from ..core.errors import run_command

DEFAULT_HOST = "127.0.0.1"  # local only unless asked: the server has no authentication
DEFAULT_PORT = 8000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="DIR", help="checkpoint directory (an `hf-loops convert`/`train` output) or Hub id")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"listen address (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"listen port (default {DEFAULT_PORT})")
    p.add_argument("--device", default="auto", help="device for inference: auto, cpu, cuda, cuda:0, ... (default auto)")
    p.add_argument("--dtype", default="auto", help="weights dtype: auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--attn-implementation", default=None,
                   choices=["eager", "sdpa", "flex_attention", "flash_attention_2"],
                   help="attention implementation (default: the checkpoint's)")
    p.add_argument("--continuous-batching", action="store_true",
                   help="transformers' paged-attention batching: SGT and TaH2 (not SpiralFormer; docs/serving.md)")
    p.add_argument("--cb-num-blocks", type=int, default=None, metavar="N",
                   help="continuous batching: paged cache capacity in blocks (default: from the free memory)")
    p.add_argument("--cb-max-batch-tokens", type=int, default=None, metavar="N",
                   help="continuous batching: tokens per batch (default: transformers')")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help='default keywords of apply_chat_template, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--enable-cors", action="store_true", help="permissive CORS headers (browser clients)")
    p.add_argument("--default-seed", type=int, default=None, help="torch seed for sampled requests")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow remote code for checkpoints that are not hf_loops architectures")
    p.add_argument("--debug", action="store_true", help="on failure, show the full traceback")


def looped_model_manager():
    """transformers' `ModelManager` whose model lookup resolves our architectures through `AutoModelForCausalLM`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import split_revision

    from ..conversion.registry import ARCHITECTURES

    class LoopedModelManager(ModelManager):
        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            model_id, revision = split_revision(model_id_and_revision)
            config = AutoConfig.from_pretrained(model_id, revision=revision, trust_remote_code=self.trust_remote_code)
            if config.model_type not in ARCHITECTURES or gguf_file is not None:
                return super()._load_model(model_id_and_revision, tqdm_class, progress_callback, gguf_file)
            kwargs = {"revision": revision, "attn_implementation": self.attn_implementation, "dtype": self.dtype,
                      "device_map": self.device, "tqdm_class": tqdm_class}
            if self.get_quantization_config() is not None:
                kwargs["quantization_config"] = self.get_quantization_config()
            return AutoModelForCausalLM.from_pretrained(model_id, **kwargs).eval()

    return LoopedModelManager


def check_model(model: str, continuous_batching: bool, attn_implementation: str | None = None) -> None:
    """A bad DIR or a setting the model cannot serve: one-line `ValueError` before the server starts."""
    from transformers import AutoConfig

    from ..conversion.registry import ARCHITECTURES

    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"{model!r} has no config.json: expected a checkpoint directory (hf-loops convert/train output)")
    if not os.path.exists(model) and model.count("/") != 1:
        raise ValueError(f"{model!r} is neither a checkpoint directory nor a Hub id (owner/name)")
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read the config of {model!r}: {' '.join(str(err).split())[:300]}") from None
    model_type = config.model_type
    if continuous_batching and model_type in ARCHITECTURES:
        reason = ARCHITECTURES[model_type].model_class.continuous_batching_refusal(config)
        if reason is not None:
            raise ValueError(f"--continuous-batching cannot serve {model_type}: {reason}; serve without "
                             "--continuous-batching (each request then runs the model's own generate)")
        if attn_implementation not in (None, "sdpa", "eager"):
            raise ValueError(f"--continuous-batching serves {model_type} with --attn-implementation sdpa or eager, "
                             f"got {attn_implementation!r} (docs/serving.md, continuous batching)")


def serve(args, non_blocking: bool = False):
    """Start the server for `args` (from `add_arguments`). Blocks until it stops, unless `non_blocking` (then returns
    an object whose `kill_server()` stops it: transformers' `Serve` before 5.25, a `ServerProcess` from 5.25)."""
    from transformers.utils.import_utils import is_serve_available

    import hf_loops  # noqa: F401  (registers our classes with the Auto classes)

    if not is_serve_available():
        raise ValueError("serving needs FastAPI, uvicorn, pydantic and openai: pip install 'hf_loops[serve]'")
    check_model(args.model, args.continuous_batching, args.attn_implementation)
    if args.chat_template_kwargs is not None:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as err:
            raise ValueError(f"--chat-template-kwargs is not valid JSON ({err.msg})") from None
        if not isinstance(kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    from transformers.cli import serve as serve_cli
    from transformers.cli.serving import model_manager

    cb_sizes = {name: value for name, value in (("cb_num_blocks", args.cb_num_blocks),
                                                ("cb_max_batch_tokens", args.cb_max_batch_tokens)) if value is not None}
    settings = dict(force_model=args.model, continuous_batching=args.continuous_batching,
                    attn_implementation=args.attn_implementation, **cb_sizes, compile=False,
                    chat_template_kwargs=args.chat_template_kwargs, device=args.device, dtype=args.dtype,
                    trust_remote_code=args.trust_remote_code, host=args.host, port=args.port,
                    enable_cors=args.enable_cors, log_level=args.log_level, default_seed=args.default_seed)
    if not serve_loads_models_in_their_own_process():
        # `Serve` imports ModelManager from its module while it is built: our subclass is what it finds, then the
        # module gets transformers' class back.
        original = model_manager.ModelManager
        model_manager.ModelManager = looped_model_manager()
        try:
            return serve_cli.Serve(**settings, non_blocking=non_blocking)
        finally:
            model_manager.ModelManager = original
    if non_blocking:  # transformers >= 5.25 serves in the foreground only: the server runs in a process of its own
        return ServerProcess(args)
    from .model_loader import LoopedModelLoader

    # `Serve` builds its `ModelLoader` from the module while it is built, then pickles it into the model's process
    original = model_manager.ModelLoader
    model_manager.ModelLoader = LoopedModelLoader
    try:
        serve_cli.Serve(**settings)
    finally:
        model_manager.ModelLoader = original


def _serve_in_the_foreground(args) -> None:
    """What a `ServerProcess` runs (by this name: `serve` itself may be wrapped in the parent, e.g. by tests)."""
    serve(args)


class ServerProcess:
    """A server started by `serve(args, non_blocking=True)` on transformers >= 5.25: `serve(args)` in a spawned
    process (its model in a process of that one's); `kill_server()` stops both, as `Serve.kill_server()` did."""

    def __init__(self, args):
        import multiprocessing

        self.process = multiprocessing.get_context("spawn").Process(target=_serve_in_the_foreground, args=(args,),
                                                                    name="hf-loops serve", daemon=False)
        self.process.start()

    def kill_server(self, timeout: float = 30.0) -> None:
        self.process.terminate()  # uvicorn stops on SIGTERM; the model's process exits with its parent
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hf-loops serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(serve, args, debug=args.debug)  # the commands' one error boundary: user errors exit 2
