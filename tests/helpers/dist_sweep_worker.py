"""Run by `torch.distributed.run --nproc_per_node 2` (gloo, CPU): the TaH2 training sweep under DDP.

Every rank gets its own batch and decider state (one rank often has no continuing token at all), so ranks execute
different depths. Per case: DDP with and without unused-parameter detection, train and eval, checkpointing on and
off. Checks a finite loss, a clean backward (no "marked ready twice"), identical gradients on both ranks, and labels
equal to the slow reference on the union of both ranks' tokens (cut-offs and class balance are pooled)."""

import faulthandler
import json
import os
import random
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.tah2_helpers import tiny_tah2
from helpers.tah2_sweep import (
    DECIDERS,
    PADDINGS,
    ArgsNS,
    flatten_records,
    install_decider,
    make_batch,
    reference_labels,
    run_case,
)


def main(out_path, n_cases):
    # A rank that waits on a collective its peer never issues would hang the suite: dump every thread's stack and
    # exit instead.
    faulthandler.dump_traceback_later(float(os.environ.get("HF_SWEEP_WATCHDOG_S", "300")), exit=True)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    rng = random.Random(99)
    args = ArgsNS()
    report = {"cases": 0, "rank_without_continuation": 0, "depths_differ": 0}
    models = {}
    for i in range(n_cases):
        M = rng.choice((2, 3))
        mode = rng.choice(("duo", "same_iter"))
        find_unused = i % 2 == 0
        train = rng.random() < 0.75
        checkpointing = rng.random() < 0.3
        # Rank 0 often stops everything; rank 1 takes any decider state.
        kinds = [rng.choice(("script_stop", "learned_stop") + DECIDERS), rng.choice(DECIDERS)]
        paddings = [rng.choice(PADDINGS), rng.choice(PADDINGS)]
        seeds = [rng.randrange(10**6), rng.randrange(10**6)]
        if (M, mode) not in models:
            models[(M, mode)] = tiny_tah2(seed=M, max_iterations=M, iteration_attention=mode)
        core = models[(M, mode)]
        core.train(train)
        core.gradient_checkpointing_enable() if checkpointing else core.gradient_checkpointing_disable()
        extra, _ = install_decider(core, kinds[rank], seeds[rank])
        batch = make_batch(random.Random(seeds[rank]), paddings[rank])
        model = DDP(core, find_unused_parameters=find_unused) if train else core
        core.zero_grad(set_to_none=True)
        try:
            loss, out, metrics, look = run_case(model, batch.inputs, extra, args)
        except Exception as err:
            raise RuntimeError(f"rank {rank} case {i} M={M} {mode} unused={find_unused} train={train} "
                               f"ckpt={checkpointing} {kinds} {paddings}: {err}") from err
        # Labels: this rank's tokens against the reference over both ranks' tokens.
        rec = out.loop_records
        flat = flatten_records(rec, look)
        gathered = [None, None]
        dist.all_gather_object(gathered, flat)
        union = [sum((g[k] for g in gathered), []) for k in range(4)]
        ref = reference_labels(*union, M, args.coverage, args.cost_min, args.cost_max, args.beta_clamp)
        offset = 0 if rank == 0 else len(gathered[0][3])
        n_local = len(flat[3])
        for m, (c_ref, _w_ref, cut_ref, beta_ref) in enumerate(ref):
            c = out.depth_labels.continue_labels[m].reshape(-1).tolist()
            assert c == c_ref[offset:offset + n_local], (i, m)
            assert abs(out.depth_labels.delta_cut[m] - cut_ref) < 1e-6, (i, m)
            assert abs(out.depth_labels.beta[m] - beta_ref) < 1e-9, (i, m)
        if train:  # DDP averaged the gradients: both ranks hold the same ones
            for name, p in core.named_parameters():
                if p.grad is None:
                    continue
                other = p.grad.clone()
                dist.broadcast(other, src=0)
                assert torch.allclose(other, p.grad, atol=1e-6), (i, name)
        depth = torch.tensor([int(out.iter_counts.max())])
        depths = [torch.zeros_like(depth) for _ in range(2)]
        dist.all_gather(depths, depth)
        report["cases"] += 1
        report["rank_without_continuation"] += int(min(int(d) for d in depths) <= 1)
        report["depths_differ"] += int(depths[0] != depths[1])
        install_decider(core, "learned_mixed", 0)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
