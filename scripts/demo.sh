#!/usr/bin/env bash
# Baton demo: sets everything up, then trains the GPT example (Flax + Optax AdamW, tied
# embedding / LM head) for a few steps as a 4-rank pipeline on 4 CPU devices, printing the
# plan summary (predicted step time, bubble %, peak memory per rank) and the loss per step.
#
#   bash scripts/demo.sh                         # ZB-H1, 4 ranks, 5 steps
#   bash scripts/demo.sh --schedule dualpipev    # any schedule name or a schedule text file
#   BATON_DEMO=plan bash scripts/demo.sh         # only plan + draw a ZB-V schedule (no JAX)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
if [[ "${BATON_DEMO:-train}" == plan ]]; then
  exec "$ROOT/.venv/bin/baton-plan" --schedule zbv --ranks 4 --microbatches 8 --grid "$@"
fi
export JAX_NUM_CPU_DEVICES="${JAX_NUM_CPU_DEVICES:-4}"
exec "$ROOT/.venv/bin/python" examples/train_demo.py --schedule zbh1 --ranks 4 --steps 5 "$@"
