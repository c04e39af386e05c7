"""The output lock of one run, which may be several processes (`core.outdir.run_output_lock`): under a distributed
launch rank 0 holds `output_lock` with the launch's key, the other ranks wait until their own run's main process holds
it and never take it; another run's lock is not theirs; a plain process locks as before."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hf_loops.core import outdir
from hf_loops.core.outdir import launch_key, launch_rank, lock_path, output_lock, run_output_lock, wait_for_run_lock

OUTDIR = os.path.abspath(outdir.__file__)
LAUNCH = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "TORCHELASTIC_RUN_ID": "none"}


def as_rank(monkeypatch, rank: int, **env):
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PMI_SIZE",
                 "OMPI_COMM_WORLD_SIZE", outdir.LOCK_WAIT_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**LAUNCH, "RANK": str(rank), **env}.items():
        monkeypatch.setenv(name, value)


def holder(out, env: dict, delay: float = 0.0):
    """A separate process that takes `out`'s lock (after `delay` seconds) as rank 0 of the launch `env` describes."""
    code = textwrap.dedent(f"""
        import importlib.util, time
        spec = importlib.util.spec_from_file_location("outdir", {OUTDIR!r})
        outdir = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(outdir)
        time.sleep({delay})
        with outdir.run_output_lock({str(out)!r}, "--output-dir"):
            print("locked", flush=True)
            time.sleep(60)
    """)
    full = {k: v for k, v in os.environ.items() if k not in LAUNCH and k != "RANK"}
    return subprocess.Popen([sys.executable, "-c", code], env={**full, **env}, stdout=subprocess.PIPE, text=True)


def test_launch_rank_and_key_from_the_launcher_environment(monkeypatch):
    as_rank(monkeypatch, 1)
    assert launch_rank() == (1, 2)
    assert launch_key() == "127.0.0.1:29533/none"
    monkeypatch.setenv("MASTER_PORT", "29534")  # another launch on the same host: another rendezvous port
    assert launch_key() == "127.0.0.1:29534/none"
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name)
    assert launch_rank() == (0, 1) and launch_key() == ""  # a plain process
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert launch_rank() == (0, 1) and launch_key() == ""  # a one-process launch is a plain process


def test_rank_0_holds_the_lock_with_the_launch_key_and_a_second_run_is_refused(monkeypatch, tmp_path):
    out = tmp_path / "run"
    as_rank(monkeypatch, 0)
    with run_output_lock(str(out), "--output-dir") as path:
        assert path == lock_path(str(out))
        with open(path) as f:
            assert f.read() == f"{os.getpid()} 127.0.0.1:29533/none"
        other = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import importlib.util
            spec = importlib.util.spec_from_file_location("outdir", {OUTDIR!r})
            outdir = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(outdir)
            try:
                with outdir.output_lock({str(out)!r}, "--output-dir"):
                    print("taken")
            except ValueError as err:
                print(err)
        """)], capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k not in LAUNCH})
        assert other.stdout.strip() == (f"--output-dir {str(out)!r} is being written by another run (pid "
                                        f"{os.getpid()}); wait for it to finish or choose another directory")
    assert not os.path.exists(lock_path(str(out)))


def test_other_ranks_wait_for_their_own_main_process_and_never_take_the_lock(monkeypatch, tmp_path):
    out = tmp_path / "run"
    as_rank(monkeypatch, 1)
    main = holder(out, {**LAUNCH, "RANK": "0"}, delay=1.0)  # this launch's rank 0, a second late
    try:
        start = time.monotonic()
        with run_output_lock(str(out), "--output-dir") as path:
            waited = time.monotonic() - start
            assert path is None  # rank 1 holds nothing
            assert main.stdout.readline().strip() == "locked"
            assert waited >= 0.9  # it waited for rank 0
            with open(lock_path(str(out))) as f:
                assert f.read() == f"{main.pid} 127.0.0.1:29533/none"  # still rank 0's lock
        assert os.path.exists(lock_path(str(out)))  # rank 1 leaving does not release or remove rank 0's lock
    finally:
        main.kill()
        main.wait()


def test_another_runs_lock_is_not_the_ranks_own(monkeypatch, tmp_path):
    """Rank 1 of launch A sees launch B's rank 0 holding the directory: it keeps waiting (its own rank 0 is refused and
    the launcher stops it) and, past the timeout, says who holds it."""
    out = tmp_path / "run"
    other = holder(out, {**LAUNCH, "RANK": "0", "MASTER_PORT": "29599"})
    try:
        assert other.stdout.readline().strip() == "locked"
        as_rank(monkeypatch, 1, **{outdir.LOCK_WAIT_ENV: "0.5"})
        with pytest.raises(ValueError) as err:
            with run_output_lock(str(out), "--output-dir"):
                pass
        assert str(err.value) == (f"--output-dir {str(out)!r}: rank 1 waited 0.5 s for its run's main process (rank 0) "
                                  f"to lock it; it is held by another run (pid {other.pid})")
    finally:
        other.kill()
        other.wait()


def test_a_lock_nobody_takes_ends_the_wait_with_the_filesystem_hint(monkeypatch, tmp_path):
    out = tmp_path / "run"
    as_rank(monkeypatch, 3)
    with pytest.raises(ValueError, match=r"rank 3 waited 0\.3 s .* it was never taken \(is the directory on a "
                                         r"filesystem that every rank shares\? set HF_LOOPS_LOCK_WAIT_S=0"):
        wait_for_run_lock(str(out), "--output-dir", timeout=0.3)
    # a stale lock file (its holder was SIGKILL-ed) is not held: it is no proof either
    os.makedirs(os.path.dirname(lock_path(str(out))), exist_ok=True)
    with open(lock_path(str(out)), "w") as f:
        f.write("12345 127.0.0.1:29533/none")
    with pytest.raises(ValueError, match="it was never taken"):
        wait_for_run_lock(str(out), "--output-dir", timeout=0.3)


def test_no_wait_when_told_and_bad_wait_values(monkeypatch, tmp_path):
    as_rank(monkeypatch, 1, **{outdir.LOCK_WAIT_ENV: "0"})
    start = time.monotonic()
    assert wait_for_run_lock(str(tmp_path / "run")) is None
    assert time.monotonic() - start < 0.5
    monkeypatch.setenv(outdir.LOCK_WAIT_ENV, "soon")
    with pytest.raises(ValueError, match=r"HF_LOOPS_LOCK_WAIT_S='soon' is not a number of seconds"):
        wait_for_run_lock(str(tmp_path / "run"))


def test_a_plain_process_locks_as_before(monkeypatch, tmp_path):
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    with run_output_lock(str(out)) as path:
        with open(path) as f:
            assert f.read() == str(os.getpid())
        with output_lock(str(out)):  # the same process again (a command, then its export): no deadlock
            pass
    assert not os.path.exists(lock_path(str(out)))
