#!/usr/bin/env bash
# Sets up .venv-maxtext: a virtual environment with Baton and MaxText, for
# baton.integrations.maxtext, examples/maxtext_pipeline.py, tests/python/test_maxtext.py and
# bench/maxtext.py. Idempotent (a second run skips what is done):
#   1. scripts/setup.sh with BATON_VENV=.venv-maxtext: Debian packages, the venv with Baton's
#      Python dependencies, Baton itself (rebuilt when its sources changed);
#   2. the `maxtext` extra of pyproject.toml (the packages MaxText's training code imports,
#      pinned), with the venv's JAX, jaxlib and NumPy held where they are;
#   3. MaxText itself with --no-deps: MaxText 0.2.5 declares every dependency under extras
#      (a TPU or CUDA stack); the extra above is what its pre-training code needs on CPUs.
# Environment: BATON_VENV (default .venv-maxtext), PYTHON (see scripts/setup.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export BATON_VENV="${BATON_VENV:-.venv-maxtext}"
VENV="$BATON_VENV"
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
MAXTEXT_VERSION=0.2.5

log() { echo "[setup-maxtext] $*" >&2; }

bash scripts/setup.sh

VPY="$VENV/bin/python"
mapfile -t extra < <("$VPY" - <<'EOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["maxtext"]))
EOF
)
STAMP="$ROOT/.stamps/maxtext-$(basename "$VENV")"
want="$(printf '%s\n' "${extra[@]}" "maxtext==$MAXTEXT_VERSION" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] \
   && "$VPY" -c "import importlib.metadata as m; assert m.version('maxtext') == '$MAXTEXT_VERSION'" \
      2>/dev/null; then
  log "ready: $VENV (MaxText $MAXTEXT_VERSION)"
  exit 0
fi

# Hold what Baton runs on: pip may otherwise move JAX or NumPy for a MaxText dependency.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$VPY" -m pip freeze --disable-pip-version-check 2>/dev/null \
  | grep -iE '^(jax|jaxlib|numpy)==' >"$constraints" || true

log "installing the maxtext extra: ${extra[*]}"
"$VPY" -m pip install -q --disable-pip-version-check -c "$constraints" "${extra[@]}"
log "installing maxtext==$MAXTEXT_VERSION (--no-deps)"
"$VPY" -m pip install -q --disable-pip-version-check --no-deps "maxtext==$MAXTEXT_VERSION"
"$VPY" -c "from baton.integrations import maxtext as m; m.require_maxtext()"
mkdir -p "$ROOT/.stamps"
echo "$want" >"$STAMP"
log "ready: $VENV (MaxText $MAXTEXT_VERSION, jax $("$VPY" -c 'import jax; print(jax.__version__)'))"
