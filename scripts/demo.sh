#!/usr/bin/env bash
# Baton demo: sets up, then plans a ZB-V pipeline (4 ranks, 8 microbatches), verifies
# and simulates it, and prints its timeline and summary table.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
"$ROOT/.venv/bin/baton-plan" --schedule zbv --ranks 4 --microbatches 8 --grid "$@"
