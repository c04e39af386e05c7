"""Run by `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo), or with one process for the reference.

mode "fsdp": one TaH2 SFT step through `TaH2SFTTrainer` whose args ask for FSDP2 (`fsdp="full_shard"`,
`fsdp_config={"fsdp_version": 2, ...}`): the Trainer/accelerate wrap every `Qwen3DecoderLayer` with `fully_shard`.
mode "eval": one evaluation step of a TaH2 with M = 3 whose ranks want different depths (rank 0 continues everywhere,
rank 1 stops after depth 1): the depth passes must be agreed over ranks or the lookahead's collectives hang.
mode "config": the same SFT step with NO FSDP settings in the Trainer's args: what `accelerate launch --config_file`
puts in the environment decides (FSDP2, FSDP1 or DDP). Records the distributed type and, per rank, how many parameters
are sharded (DTensor) and how many elements this rank holds. A one-line refusal (ValueError) is saved as `refused`.
Each rank saves its batch, labels, δ_cut, β, loss (and, for fsdp, the full weights after the step) to
OUT/{mode}_rank{r}.pt."""

import faulthandler
import os
import sys

import torch
from datasets import Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: `helpers`

from helpers.conversion_helpers import tiny_tokenizer
from helpers.tah2_helpers import script_decider, tiny_tah2
from hf_loops.training.tah2_trainer import TaH2SFTConfig, TaH2SFTTrainer
from hf_loops.training.train_tah2 import check_launch, final_state_dict, fsdp_on_cpu, unsharded_model

ROWS, LENGTH, M = 4, 12, 3


def fixed_rows():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 70, (ROWS, LENGTH), generator=g)
    return [{"input_ids": row.tolist()} for row in ids]


def model():
    return tiny_tah2(seed=0, max_iterations=M, exit_threshold=0.5)


class Recording(TaH2SFTTrainer):
    def tah2_loss(self, model, inputs, num_items_in_batch=None, return_logits=False):
        loss, outputs, metrics = super().tah2_loss(model, inputs, num_items_in_batch, return_logits)
        labels = getattr(outputs, "depth_labels", None)
        self.recorded = {
            "input_ids": inputs["input_ids"].detach().cpu(), "loss": float(loss.detach()),
            "num_items_in_batch": None if num_items_in_batch is None else int(num_items_in_batch),
            "continue_labels": None if labels is None else [c.cpu() for c in labels.continue_labels],
            "delta_cut": None if labels is None else list(labels.delta_cut),
            "beta": None if labels is None else list(labels.beta),
            "metrics": {k: (float(a), float(b)) for k, (a, b) in metrics.items()},
        }
        return loss, outputs, metrics


def main(mode, out):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    common = dict(output_dir=os.path.join(out, "run"), use_cpu=True, bf16=False, report_to="none", seed=0,
                  max_steps=1, learning_rate=1e-3, per_device_train_batch_size=ROWS // world,
                  per_device_eval_batch_size=ROWS // world, gradient_checkpointing=False, save_strategy="no",
                  logging_steps=1, dataloader_num_workers=0, disable_tqdm=True, max_length=None,
                  padding_free=False, dataset_kwargs={"skip_prepare_dataset": False})
    net = model()
    if mode == "config":
        return config_step(net, common, world, out)
    if mode == "fsdp":
        if world > 1:
            common.update(fsdp="full_shard", fsdp_config={
                "fsdp_version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"],
                "reshard_after_forward": True, "state_dict_type": "FULL_STATE_DICT"})
        args = TaH2SFTConfig(**common)
        trainer = Recording(model=net, args=args, train_dataset=Dataset.from_list(fixed_rows()),
                            processing_class=tiny_tokenizer())
        assert fsdp_on_cpu(trainer) == (world > 1)  # the Trainer's FSDP settings, applied on CPU as on GPUs
        trainer.get_train_dataloader = lambda: sharded_loader(trainer, world)
        trainer.train()
        wrapped = type(trainer.model_wrapped).__name__
        layer = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        from hf_loops.training.tah2_trainer import _unwrap

        layer = _unwrap(layer).model.layers[0]
        trainer.recorded["sharded_layer"] = type(layer).__name__
        trainer.recorded["wrapped"] = wrapped
        state = final_state_dict(trainer)  # collective under FSDP
        if state is None:
            state = trainer.model.state_dict()
        trainer.recorded["weights"] = {k: v.detach().cpu().clone() for k, v in state.items()}
        if world > 1:  # what `hf-loops train` saves: a plain model of the trained class (not torch's FSDP<Class>)
            trainer.recorded["saved_class"] = type(unsharded_model(trainer, state)).__name__
        trainer.recorded["grad_norm"] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    else:
        rank = int(os.environ.get("RANK", "0"))
        script_decider(net, lambda e, h: torch.full(e.shape[:-1], 0.9 if rank == 0 else 0.1))
        args = TaH2SFTConfig(**common)
        trainer = Recording(model=net, args=args, train_dataset=Dataset.from_list(fixed_rows()),
                            eval_dataset=Dataset.from_list(fixed_rows()),
                            processing_class=tiny_tokenizer())
        trainer.recorded_metrics = trainer.evaluate()
        trainer.recorded["eval_metrics"] = trainer.recorded_metrics
    rank = int(os.environ.get("RANK", "0"))
    if out is not None:
        torch.save(trainer.recorded, os.path.join(out, f"{mode}_rank{rank}.pt"))
    return trainer.recorded


def config_step(net, common, world, out):
    """One SFT step where only the launcher's environment asks for FSDP (the Trainer's args do not)."""
    from torch.distributed.tensor import DTensor

    rank = int(os.environ.get("RANK", "0"))
    args = TaH2SFTConfig(**common)
    try:
        check_launch(args)  # what `hf-loops train` does before it builds the Trainer
        trainer = Recording(model=net, args=args, train_dataset=Dataset.from_list(fixed_rows()),
                            processing_class=tiny_tokenizer())
        fsdp_on_cpu(trainer)
    except ValueError as err:
        record = {"refused": str(err)}
        torch.save(record, os.path.join(out, f"config_rank{rank}.pt"))
        return record
    chosen = str(trainer.accelerator.state.distributed_type)
    trainer.get_train_dataloader = lambda: sharded_loader(trainer, world)
    trainer.train()
    params = list(trainer.model_wrapped.parameters())
    trainer.recorded.update(
        distributed_type=chosen, wrapped=type(trainer.model_wrapped).__name__,
        parameters=len(params), sharded=sum(isinstance(p, DTensor) for p in params),
        local_elements=sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        full_elements=sum(p.numel() for p in params),
        grad_norm=[h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h])
    state = final_state_dict(trainer)  # collective under FSDP
    state = trainer.model.state_dict() if state is None else state
    trainer.recorded["weights"] = {k: v.detach().cpu().clone() for k, v in state.items()}
    torch.save(trainer.recorded, os.path.join(out, f"config_rank{rank}.pt"))
    return trainer.recorded


def sharded_loader(trainer, world):
    """Rank r gets rows [r·B, (r+1)·B) in order (no shuffling), so the union is the fixed batch."""
    rank = int(os.environ.get("RANK", "0"))
    rows = fixed_rows()[rank * ROWS // world:(rank + 1) * ROWS // world]
    ids = torch.tensor([r["input_ids"] for r in rows])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return [batch]


if __name__ == "__main__":
    # A rank waiting on a collective its peer never issues would hang the suite: dump the stacks and exit instead.
    # Armed here, in the launched ranks only: the one-process reference calls `main` inside pytest, where an armed
    # watchdog would end the whole test session 300 s later.
    faulthandler.dump_traceback_later(float(os.environ.get("HF_DIST_WATCHDOG_S", "300")), exit=True)
    for mode in sys.argv[1].split(","):  # "eval,fsdp": evaluation first (DDP), then the FSDP2 step
        main(mode, sys.argv[2])
