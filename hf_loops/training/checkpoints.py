"""Training checkpoints that are complete or absent.

The Trainer writes `checkpoint-N` in place, file after file: a run killed (SIGTERM, SIGKILL, a full disk) while saving
leaves a folder with only some of them, and `--resume-from-checkpoint true` (the newest `checkpoint-N`) then picks it
and fails. Here every checkpoint is written into a staging folder beside the run (`.hf_loops_export_<pid>_checkpoints/
checkpoint-N`, a name that `checkpoint-N` patterns never match) and renamed into place once every file is written, so
an interrupted save loses at most that one checkpoint; the next save (or run) removes the staging leftovers of a
process that is gone."""

from __future__ import annotations

import contextlib
import os
import re
import shutil

from ..core.outdir import TMP_PREFIX, remove_stale_exports

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# Written last by `Trainer._save_checkpoint` (after the weights, optimizer, scheduler and RNG states): a checkpoint
# folder without it was interrupted (older runs, or checkpoints written by something else).
STATE_FILE = "trainer_state.json"


def staging_root(run_dir: str) -> str:
    """The staging folder of this run's saves. All ranks of one launch use the same one: the launcher's pid under a
    distributed launch (every rank's parent), this process's pid otherwise."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return os.path.join(run_dir, f"{TMP_PREFIX}{os.getppid() if distributed else os.getpid()}_checkpoints")


def complete_checkpoints(run_dir: str) -> list[str]:
    """The `checkpoint-N` folders of `run_dir` that hold a trainer state (complete), oldest step first."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    found = []
    for name in names:
        m = _CHECKPOINT.match(name)
        path = os.path.join(run_dir, name)
        if m and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(m.group(1)), path))
    return [path for _, path in sorted(found)]


def last_complete_checkpoint(run_dir: str) -> str:
    """The newest complete checkpoint of `run_dir` (for `--resume-from-checkpoint true`); incomplete ones are named in
    the error when there is none."""
    done = complete_checkpoints(run_dir)
    if done:
        return done[-1]
    partial = sorted(n for n in (os.listdir(run_dir) if os.path.isdir(run_dir) else []) if _CHECKPOINT.match(n))
    detail = f" ({', '.join(partial)} lack {STATE_FILE}: interrupted while saving)" if partial else ""
    raise ValueError(f"--resume-from-checkpoint true: no complete checkpoint-N in {run_dir!r}{detail}")


class AtomicCheckpointsMixin:
    """A `Trainer` mixin: `_save_checkpoint` writes into the staging folder, then renames `checkpoint-N` into the run
    directory; rotation (`save_total_limit`) and `best_model_checkpoint` see the final names."""

    _staging = None

    def _get_output_dir(self, trial):
        run_dir = super()._get_output_dir(trial)
        return self._staging or run_dir

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import rotate_checkpoints

        run_dir = super()._get_output_dir(trial)
        staging = staging_root(run_dir)
        name = f"checkpoint-{self.state.global_step}"
        if self.args.should_save:
            remove_stale_exports(run_dir)  # staging folders of killed runs
            os.makedirs(staging, exist_ok=True)
        self._barrier()
        self._staging = staging
        try:
            super()._save_checkpoint(model, trial)
        except BaseException:  # a full disk, a signal: the partial checkpoint goes, the complete ones stay
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            self._staging = None
        self._barrier()  # every rank has written its files (RNG states, optimizer shards)
        if self.args.should_save:
            _move_into_place(os.path.join(staging, name), os.path.join(run_dir, name))
            with contextlib.suppress(OSError):
                os.rmdir(staging)
            best = self.state.best_model_checkpoint
            if best and os.path.dirname(os.path.abspath(best)) == os.path.abspath(staging):
                self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self._barrier()

    def _barrier(self) -> None:
        if self.args.world_size > 1:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.barrier()


def _move_into_place(src: str, dst: str) -> None:
    """Rename the finished checkpoint `src` to `dst`; an older `dst` (the same step saved again after a resume) is
    moved aside first and removed after, so `dst` is the old or the new checkpoint at every moment."""
    if os.path.lexists(dst):
        trash = f"{src}.old"
        os.replace(dst, trash)
        os.replace(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(src, dst)
