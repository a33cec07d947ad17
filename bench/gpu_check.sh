#!/usr/bin/env bash
# First contact with a GPU machine: runs bench/gpu_check.py (one `ROW name|PASS|FAIL|INFO|detail`
# line per row, `UNTESTED: ...` last; exit 1 when any row this hardware can run did not run or
# failed). docs/GPU.md says what each row proves and the command to run when a GPU is lent.
#
#   bash bench/gpu_check.sh [python]              # on the GPU machine (<= 8 minutes on one GPU)
#   bash bench/gpu_check.sh [python] --dry-run    # anywhere: the rows' plumbing, no GPU work
#
# baton._core is not built on the GPU machine (building takes most of a lent machine's
# time): it is built beforehand on the build machine against the same Python and jaxlib
# (`bash /tmp/baton_rebuild.sh` or scripts/setup.sh: build/py/_core*.so, which
# python/baton/_core*.so links to) and carried with the tree (about 3 MiB). Without it the
# build row fails, and so does every row that needs it.
# Environment: PYTHONPATH is prepended with a copy of python/baton holding the carried
# extension, and examples/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
if [[ $# -gt 0 && "$1" != --* ]]; then PY=$1; shift; fi
SO=$(ls build/py/_core*.so 2>/dev/null | head -1)
if [[ -z "$SO" ]]; then
  echo "ROW build|FAIL|no build/py/_core*.so (build it beforehand on the build machine and carry it)"
  echo "UNTESTED: everything else (no build)"
  exit 1
fi
# Baton from this tree with the carried extension (python/baton's link to it may not resolve).
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
cp -r python/baton "$STAGE/" && rm -f "$STAGE"/baton/_core*.so && cp "$SO" "$STAGE/baton/"
export PYTHONPATH="$STAGE:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}"
timeout --kill-after=20 480 "$PY" bench/gpu_check.py "$@"
