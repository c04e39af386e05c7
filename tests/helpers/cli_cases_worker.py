"""Runs many `hf-loops` command lines in ONE process (imports paid once): `python cli_cases_worker.py CASES.json
RESULTS.json`. Each case is {"name", "argv", "cwd"}; its exit code and the text written to the stdout/stderr file
descriptors (everything: print, logging, warnings, tqdm) are recorded."""

import json
import os
import sys
import tempfile
import traceback


def run_case(main, case):
    os.chdir(case["cwd"])
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            try:
                rc = main(case["argv"])
            except SystemExit as exc:  # argparse
                rc = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                traceback.print_exc()
                rc = "raised"
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
        out.seek(0), err.seek(0)
        return {"rc": rc, "stdout": out.read(), "stderr": err.read()}


def run_table(cases: dict, root, timeout: int = 600) -> dict:
    """Run a bad-input table {name: (argv, cwd, ...)} through `hf_loops.cli.main` in one subprocess (this file);
    returns {name: {"rc", "stdout", "stderr"}}. The package of this checkout comes before any installed copy."""
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
    spec = [{"name": n, "argv": a, "cwd": str(c)} for n, (a, c, *_rest) in cases.items()]
    cases_path, results_path = os.path.join(root, "cases.json"), os.path.join(root, "results.json")
    with open(cases_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)]))
    res = subprocess.run([sys.executable, os.path.abspath(__file__), cases_path, results_path], env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(results_path) as f:
        return json.load(f)


def main():
    cases_path, results_path = sys.argv[1:3]
    from hf_loops.cli import main as cli_main

    with open(cases_path) as f:
        cases = json.load(f)
    results = {case["name"]: run_case(cli_main, case) for case in cases}
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
