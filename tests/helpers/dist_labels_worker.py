"""Run by `accelerate launch --num_processes 2 --cpu`: each rank labels its half of a fixed batch; rank 0 saves
δ_cut, β and the labels of both halves so the test can compare them with one process on the union."""

import sys

import torch
from accelerate import Accelerator

from hf_loops.training.tah2_labels import compute_depth_labels


def fixed_batch():
    g = torch.Generator().manual_seed(0)
    B, T, M = 4, 9, 3
    executed = [torch.ones(B, T, dtype=torch.bool)]
    for _ in range(M - 1):
        executed.append(executed[-1] & (torch.rand(B, T, generator=g) > 0.3))
    losses = [torch.rand(B, T, generator=g) * 3 for _ in range(M)]
    look = [losses[m] - torch.randn(B, T, generator=g) * 0.5 for m in range(1, M)]
    supervised = torch.rand(B, T, generator=g) > 0.2
    return executed, losses, look, supervised, M


def main(out_path):
    acc = Accelerator(cpu=True)
    executed, losses, look, supervised, M = fixed_batch()
    rank, world = acc.process_index, acc.num_processes
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    lab = compute_depth_labels([e[rows] for e in executed], [l[rows] for l in losses], [l[rows] for l in look],
                               supervised[rows], M, coverage=0.9)
    gathered = acc.gather(torch.stack([c.long() for c in lab.continue_labels]).transpose(0, 1).contiguous())
    if acc.is_main_process:
        torch.save({"delta_cut": lab.delta_cut, "beta": lab.beta, "world": world,
                    "labels": gathered.transpose(0, 1)}, out_path)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
