#!/bin/bash
# The deeper arms of the evidence for the 2-head base (one process at a time, 2 threads).
set -e
cd "$(dirname "$0")"
export PYTHONPATH=$(cd ../.. && pwd)
PY=${PY:-$PYTHONPATH/.venv/bin/python}  # the repository's venv (make install)
COMMON="--heads 2 --nine-prob 0.5 --steps 2000 --eval-every 500 --threads 2 --no-save"
$PY pretrain_base.py --layers 1 --looped 2 $COMMON
$PY pretrain_base.py --layers 2 $COMMON
