"""One benchmark suite for TaH2, SpiralFormer and SGT: every row of issue 14's speed-and-memory table.

    python -m bench all [--device cpu|cuda] [--dtype float32|bfloat16] [--quick] [--sizes tiny,100m] [--rows ...]

Each row is a ratio to a baseline measured side by side in the same run (same weights, interleaved repeats, best of
N after one warm-up), so it travels between machines. Results go to `bench/results/<device>.json` and `.md`; see
bench/README.md. Not a timed test: `tests/test_bench_suite.py` checks only the structure of a `--quick` run.
"""
