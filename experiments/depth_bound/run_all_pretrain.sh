#!/bin/bash
# The base, then the two deeper arms of the evidence (one process at a time, one thread each).
set -e
cd "$(dirname "$0")"
export PYTHONPATH=$(cd ../.. && pwd)
PY=${PY:-$PYTHONPATH/.venv/bin/python}  # the repository's venv (make install)
$PY pretrain_base.py --layers 1 --steps 4000 "$@"
$PY pretrain_base.py --layers 1 --looped 2 --steps 2500 --no-save "$@"
$PY pretrain_base.py --layers 2 --steps 2500 --no-save "$@"
