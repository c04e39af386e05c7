"""Output directories that hold one complete result or nothing (stdlib only: no torch/transformers import).

Every command that writes a directory (convert, train, pretrain, eval, analyze, demo) goes through this module:

- `check_output_dir`: before any work, a new path (creatable) or an existing empty, writable directory (`.`, a mount
  point); a file, a non-empty directory (unless `overwrite`) or a read-only location is refused with one message.
- `atomic_output_dir`: write into a temporary directory, then rename it into place (new path), swap it with the old
  one (`overwrite`), or move its files into the existing directory with `config.json` last; removed on any failure,
  SIGTERM included; files and folders get the modes the umask gives (not mkdtemp's 0700).
- `output_lock`: an advisory lock (fcntl) per output directory, so two runs cannot write into one directory.
- `run_output_lock`: the lock of one run, which may be several processes: under a distributed launch (`accelerate
  launch`, `torchrun`: `WORLD_SIZE` > 1) the main process (rank 0) holds `output_lock` and the other ranks wait until
  their own run's main process holds it, then go on without taking it.
- `remove_stale_exports`: leftovers of a SIGKILL-ed run (`.hf_loops_export_<pid>_*`) are named and removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

# Temporary directories of an export in progress: `<prefix><pid>_<random>`, so a later export can tell the leftovers of
# a killed process (SIGKILL cannot be caught) from the directory of a concurrent export that is still running.
TMP_PREFIX = ".hf_loops_export_"
# Written last when files are moved into an existing directory: a directory without it holds no loadable model.
LAST_FILE = "config.json"
# The advisory lock of a directory being written: beside it while it does not exist yet (`.<name>.hf_loops.lock` in
# the parent), so that the lock is the same file before and after the directory appears.
LOCK_SUFFIX = ".hf_loops.lock"
LOCK_NAME = ".hf_loops.lock"  # inside the directory, where its parent cannot be written (`.` in a read-only parent)
_HELD: dict[str, int] = {}  # lock files this process holds → nesting depth
# How long the other ranks of a distributed launch wait for their main process to hold the lock (seconds; 0: go on
# without waiting, for an output directory that is not on a filesystem every rank shares).
LOCK_WAIT_ENV = "HF_LOOPS_LOCK_WAIT_S"
LOCK_WAIT_S = 600.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_exports(folder: str) -> list[str]:
    """Remove the `.hf_loops_export_*` leftovers of killed exports in `folder` (those whose process is gone), naming
    each in a warning on stderr. Returns the removed paths."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(TMP_PREFIX):
            continue
        pid = name[len(TMP_PREFIX):].split("_", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or _pid_alive(int(pid))):
            continue  # an export that is still running (this process's or a concurrent one)
        path = os.path.join(folder, name)
        print(f"warning: removing {path!r}, the leftover of an interrupted export", file=sys.stderr)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _visible_entries(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.startswith(TMP_PREFIX) and n != LOCK_NAME)


def clear_dir(folder: str) -> None:
    """Empty `folder` in place (it may be `.` or a mount point), keeping its lock and the staging folders of running
    writers."""
    for name in _visible_entries(folder):
        full = os.path.join(folder, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        else:
            os.remove(full)


def check_output_dir(out_dir: str | os.PathLike, what: str = "--out", overwrite: bool = False,
                     hint: str = "") -> str:
    """Check, before any work, that `out_dir` can receive a result: it is a new path whose nearest existing parent is a
    writable directory, or an existing empty writable directory (`.` and mount points included), or any directory with
    `overwrite`. Returns the absolute path. `ValueError` for a file or a refused non-empty directory (`hint` says how
    to replace it), `PermissionError` for a location that cannot be written."""
    raw = os.fspath(out_dir)
    if not raw.strip():
        raise ValueError(f"{what} is empty: give a directory path")
    out = os.path.abspath(raw)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{what} {raw!r} is a file; expected a new or empty directory")
    if os.path.isdir(out):
        remove_stale_exports(out)
        entries = _visible_entries(out)
        if entries and not overwrite:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise ValueError(f"{what} {raw!r} exists and is not empty ({len(entries)} entries: {shown}); "
                             f"expected a new or empty directory{hint}")
        probe_in = out
    else:
        probe_in = os.path.dirname(out)
        while not os.path.exists(probe_in):
            probe_in = os.path.dirname(probe_in)
        if not os.path.isdir(probe_in):
            raise ValueError(f"{what} {raw!r}: {probe_in!r} is a file, so the directory cannot be created")
    try:  # os.access is unreliable (root, read-only mounts): create and remove a probe instead
        probe = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}_probe_", dir=probe_in)
        os.rmdir(probe)
    except OSError as err:
        raise PermissionError(err.errno, f"{what} {raw!r}: cannot write in {probe_in!r} ({err.strerror}); choose a "
                                         "writable location") from None
    return out


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def _normal_permissions(folder: str) -> None:
    """Files and folders written through temporary files (0600/0700) get the modes the umask gives new ones."""
    mode = _default_mode()
    os.chmod(folder, mode)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), mode)
        for name in files:
            os.chmod(os.path.join(root, name), mode & 0o666)


@contextlib.contextmanager
def _remove_on_sigterm(path: str):
    """On SIGTERM, remove `path` (the handler raises SystemExit, so the `except BaseException` cleanup runs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def move_files_into(src: str, dst: str) -> None:
    """Move every entry of `src` into the existing directory `dst`, replacing same-named ones, with `config.json` last
    (an old `config.json` in `dst` is removed first): at every moment `dst` holds the old complete model, no
    `config.json` (nothing loadable), or the new complete model."""
    names = sorted(os.listdir(src), key=lambda n: n == LAST_FILE)
    if LAST_FILE in names and os.path.lexists(os.path.join(dst, LAST_FILE)):
        os.remove(os.path.join(dst, LAST_FILE))
    for name in names:
        target = os.path.join(dst, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(src, name), target)


def _swap_into_place(tmp: str, out: str) -> None:
    """Replace the non-empty directory `out` with `tmp`: the old one is moved aside first and removed after, so `out`
    names the old result or the new one at every moment but one rename. Where `out` cannot be renamed (`.`, a mount
    point), its entries are removed and the new files moved in with `config.json` last."""
    trash = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}_old_", dir=os.path.dirname(out))
    try:
        os.replace(out, os.path.join(trash, "old"))
    except OSError as err:
        os.rmdir(trash)
        if err.errno not in (errno.EBUSY, errno.EINVAL, errno.EACCES, errno.EPERM, errno.EXDEV):
            raise
        clear_dir(out)
        move_files_into(tmp, out)
        os.rmdir(tmp)
        return
    os.replace(tmp, out)
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(out_dir: str, what: str = "export", merge: bool = False, overwrite: bool = False,
                      label: str | None = None, lock: bool = True):
    """Yield a temporary directory to write into; on success its files land in `out_dir`, on any failure (SIGTERM
    included) it is removed, so `out_dir` is never left half-written.

    A new `out_dir`: the temporary sibling is renamed into place (atomic). An existing empty directory (`.`, a mount
    point) is kept, not rmdir-ed: the temporary directory is made inside it (same filesystem) and its files are moved
    in with `config.json` last. `overwrite=True` replaces a non-empty `out_dir` (moved aside, then removed) once the
    new result is complete. `merge=True` allows a non-empty `out_dir` (a training run's directory) and moves the
    files in the same way. Leftovers of killed runs (`.hf_loops_export_<pid>_*`) are removed with a warning. The
    directory is locked (`output_lock`) for the whole block unless `lock=False` (the caller holds the lock)."""
    out = os.path.abspath(os.fspath(out_dir))
    if not merge:
        check_output_dir(out_dir, label or f"{what} out_dir", overwrite=overwrite)
    parent = os.path.dirname(out)
    if not lock:
        os.makedirs(parent, exist_ok=True)
    with output_lock(out, label or what) if lock else contextlib.nullcontext():  # the lock makes the parent
        remove_stale_exports(parent)
        existing = os.path.isdir(out)
        if existing:
            remove_stale_exports(out)
        replace = existing and not merge and bool(_visible_entries(out))
        if replace and not overwrite:  # another run filled it since the check
            check_output_dir(out_dir, label or f"{what} out_dir")
        tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}_", dir=out if existing and not replace else parent)
        try:
            with _remove_on_sigterm(tmp):
                yield tmp
                _normal_permissions(tmp)
                if replace:
                    _swap_into_place(tmp, out)
                elif existing:
                    move_files_into(tmp, out)
                    os.rmdir(tmp)
                else:
                    os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _missing_ancestor(folder: str) -> str | None:
    """The highest ancestor of `folder` (itself included) that does not exist yet, or None."""
    missing = None
    while folder and not os.path.exists(folder):
        missing, folder = folder, os.path.dirname(folder)
        if folder == missing:
            break
    return missing


def _remove_empty_up_to(folder: str, top: str) -> None:
    """Remove `folder` and its parents up to `top` while they are empty."""
    while True:
        try:
            os.rmdir(folder)
        except OSError:
            return
        if folder == top:
            return
        folder = os.path.dirname(folder)


def lock_path(out_dir: str) -> str:
    """Where the lock of `out_dir` lives: `.<name>.hf_loops.lock` beside it, or inside it when the parent is not
    writable (an existing `.` in a read-only parent)."""
    out = os.path.abspath(os.fspath(out_dir))
    parent, name = os.path.split(out)
    beside = os.path.join(parent, f".{name}{LOCK_SUFFIX}")
    if os.path.isdir(out) and not os.access(parent, os.W_OK | os.X_OK):
        return os.path.join(out, LOCK_NAME)
    return beside


def _holder(fd: int) -> tuple[str, str]:
    """(pid, run key) written in a lock file: `<pid>` or `<pid> <run key>`."""
    words = os.pread(fd, 512, 0).decode("ascii", "replace").split()
    return (words[0] if words else "another process"), (words[1] if len(words) > 1 else "")


@contextlib.contextmanager
def output_lock(out_dir: str, what: str = "--out", run: str = ""):
    """Hold an exclusive advisory lock (fcntl) on `out_dir` for the block: a second run that asks for the same
    directory is refused at once with `ValueError` naming the process that holds it. The lock file holds this
    process's pid and `run` (a distributed launch's key, `launch_key()`, so that the run's other ranks can tell their
    own main process from another run's). The lock file is removed when the block ends. Without fcntl (Windows),
    nothing is locked."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no advisory locks on this platform
        yield
        return
    path = lock_path(out_dir)
    if path in _HELD:  # this process holds it already (a command locks, then the export inside it locks again)
        _HELD[path] += 1
        try:
            yield path
        finally:
            _HELD[path] -= 1
        return
    created = _missing_ancestor(os.path.dirname(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                os.close(fd)
                raise
            holder, _ = _holder(fd)
            os.close(fd)
            raise ValueError(f"{what} {out_dir!r} is being written by another run (pid {holder}); wait for it to "
                             "finish or choose another directory") from None
        # The file may have been removed by the holder that just released it: then lock the new file instead.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    _HELD[path] = 1
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {run}".strip().encode(), 0)
        yield path
    finally:
        del _HELD[path]
        with contextlib.suppress(OSError):
            os.remove(path)
        os.close(fd)
        if created is not None and not os.path.exists(os.path.abspath(os.fspath(out_dir))):
            _remove_empty_up_to(os.path.dirname(path), created)  # a refused run leaves no empty parents behind


def launch_rank() -> tuple[int, int]:
    """(rank, world size) of this process in a distributed launch, from the launcher's environment (`torchrun`,
    `accelerate launch`: RANK / WORLD_SIZE); (0, 1) for a plain process."""
    def number(*names: str, default: int) -> int:
        for name in names:
            value = os.environ.get(name, "").strip()
            if value.isdigit():
                return int(value)
        return default

    world = number("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", default=1)
    rank = number("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", default=0) if world > 1 else 0
    return rank, world


def launch_key() -> str:
    """What the processes of one distributed launch share and two concurrent launches cannot: the rendezvous address
    (MASTER_ADDR:MASTER_PORT, bound by one launch at a time) and the launcher's run id. Empty for a plain process."""
    if launch_rank()[1] == 1:
        return ""
    addr = os.environ.get("MASTER_ADDR", "")
    port = os.environ.get("MASTER_PORT", "")
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return "".join(c if c.isalnum() or c in ".:-_/[]" else "_" for c in f"{addr}:{port}/{run}")


def _held_by(path: str) -> tuple[str, str] | None:
    """(pid, run key) of the process that holds the lock file `path` now; None when nobody holds it."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            return _holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it (a holder that just released it, or not there yet)
        return None
    finally:
        os.close(fd)


def wait_for_run_lock(out_dir: str, what: str = "--out", timeout: float | None = None,
                      poll: float = 0.1) -> str | None:
    """Block until `out_dir`'s lock is held by the main process of this process's own distributed launch (the same
    `launch_key()`); returns that process's pid. `timeout` (default: `$HF_LOOPS_LOCK_WAIT_S`, else 600 s) ends the
    wait with `ValueError`; 0 returns None at once without waiting. While another run holds the lock, this run's main
    process is refused and its launcher stops this process; the wait goes on until then."""
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - nothing is locked on this platform
        return None
    if timeout is None:
        text = os.environ.get(LOCK_WAIT_ENV, "").strip()
        try:
            timeout = float(text) if text else LOCK_WAIT_S
        except ValueError:
            raise ValueError(f"{LOCK_WAIT_ENV}={text!r} is not a number of seconds") from None
    if timeout <= 0:
        return None
    key, rank = launch_key(), launch_rank()[0]
    path = lock_path(out_dir)
    deadline = time.monotonic() + timeout
    other = None
    while True:
        held = _held_by(path)
        if held is not None and held[1] == key:
            return held[0]
        other = held or other
        if time.monotonic() >= deadline:
            seen = (f"; it is held by another run (pid {other[0]})" if other is not None else
                    "; it was never taken (is the directory on a filesystem that every rank shares? set "
                    f"{LOCK_WAIT_ENV}=0 to go on without waiting)")
            raise ValueError(f"{what} {out_dir!r}: rank {rank} waited {timeout:g} s for its run's main process (rank "
                             f"0) to lock it{seen}")
        time.sleep(poll)


@contextlib.contextmanager
def run_output_lock(out_dir: str, what: str = "--out"):
    """The lock of one run into `out_dir`, held for the block. A plain process holds `output_lock`. Under a distributed
    launch (WORLD_SIZE > 1) the run's main process (rank 0), which writes what only the main process writes, holds it
    with the launch's key; every other rank waits at start-up until its own main process holds it
    (`wait_for_run_lock`) and never takes it. A second, separate run into the same directory is refused as before
    (its main process fails at once; its other ranks are stopped by their launcher)."""
    rank, _ = launch_rank()
    if rank == 0:
        with output_lock(out_dir, what, run=launch_key()) as path:
            yield path
    else:
        wait_for_run_lock(out_dir, what)
        yield None
