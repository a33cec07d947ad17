#!/usr/bin/env bash
# Sets up everything Baton needs, idempotently and quickly when nothing changed:
#   1. Debian packages (compiler, CMake, C++ libraries; iproute2 for the two-host test over
#      network namespaces), installed only if missing;
#   2. the virtual environment .venv (Python 3.12) with Baton's Python dependencies;
#   3. Baton itself (C++ core, bindings, baton-plan) pip-installed into .venv, rebuilt
#      only when the sources changed since the last install.
# Environment: BATON_FORCE_INSTALL=1 reinstalls Baton; PYTHON=/path/to/python3.12
# chooses the interpreter used to create .venv. BATON_VENV=DIR sets up DIR instead of .venv
# (its own build directory, build/py-<name>); BATON_JAX="jax==X jaxlib==X" pins JAX there
# (scripts/test.sh --jax-oldest: the oldest JAX Baton supports).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${BATON_VENV:-$ROOT/.venv}"
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
VNAME="$(basename "$VENV")"
STAMPS="$ROOT/.stamps"
BUILD_PY="build/py"
[[ "$VNAME" == ".venv" ]] || BUILD_PY="build/py-${VNAME#.}"

log() { echo "[setup] $*" >&2; }
die() { echo "[setup] error: $*" >&2; exit 1; }

# --- 1. system packages --------------------------------------------------------
APT_PACKAGES=(cmake ninja-build g++ make git libgtest-dev libbenchmark-dev nlohmann-json3-dev
              libcli11-dev libfmt-dev libgloo-dev iproute2)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" 2>/dev/null | grep '^Status: install ok installed' >/dev/null || missing+=("$pkg")
done
if ((${#missing[@]})); then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || die "need root (or sudo) to install: ${missing[*]}"
    SUDO="sudo"
  fi
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

# --- 2. virtual environment --------------------------------------------------------
find_python() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  local root cand
  if command -v pyenv >/dev/null 2>&1; then
    root="$(pyenv root)"
  else
    root="${PYENV_ROOT:-$HOME/.pyenv}"
  fi
  # Newest 3.12.x that pyenv has.
  cand="$(ls -d "$root"/versions/3.12.*/bin/python 2>/dev/null | sort -V | tail -n1 || true)"
  if [[ -n "$cand" && -x "$cand" ]]; then echo "$cand"; return; fi
  command -v python3.12 2>/dev/null || true
}

if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
  PY="$(find_python)"
  [[ -n "$PY" ]] || die "Python 3.12 not found (pyenv versions/3.12.* or python3.12 on PATH)"
  log "creating $VENV with $PY"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' \
  || die "$VENV uses Python $("$VPY" -V 2>&1); Baton needs >= 3.12 (remove .venv to recreate)"

# Minimum versions; pip installs only what is missing or too old.
PY_REQUIREMENTS=("jax>=0.11" "flax>=0.10" "optax>=0.2" "orbax-checkpoint>=0.12" "numpy>=1.26"
                 "pytest>=8" "pytest-xdist>=3.2" "pytest-timeout>=2.3" "hypothesis>=6" "filelock>=3" "nanobind>=2.4"
                 "scikit-build-core>=0.10" "tensorboardX>=2.6" "tensorboard>=2.15" "jsonschema>=4"
                 "pyyaml>=6" "grain>=0.2")
mapfile -t need < <("$VPY" - "${PY_REQUIREMENTS[@]}" <<'EOF'
import re, sys
from importlib.metadata import PackageNotFoundError, version

def key(v):
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])

for req in sys.argv[1:]:
    name, _, minimum = req.partition(">=")
    try:
        if key(version(name)) >= key(minimum):
            continue
    except PackageNotFoundError:
        pass
    print(req)
EOF
)
# The packages go in with uv (itself from PyPI, into the venv): it resolves and downloads in
# parallel, 36 s -> 5 s for the list above on the 2-core VM (pip's and uv's caches warm).
# pip's certificate bundle and wheel folder (PIP_CERT, PIP_FIND_LINKS) apply to uv too.
py_install() {
  if [[ ! -x "$VENV/bin/uv" ]]; then
    "$VPY" -m pip install -q --disable-pip-version-check uv || die "could not install uv"
  fi
  local links=()
  [[ -n "${PIP_FIND_LINKS:-}" ]] && links=(--find-links "$PIP_FIND_LINKS")
  if [[ -n "${PIP_CERT:-}" && -z "${SSL_CERT_FILE:-}" ]]; then
    SSL_CERT_FILE="$PIP_CERT" "$VENV/bin/uv" pip install -q --python "$VPY" "${links[@]}" "$@"
  else
    "$VENV/bin/uv" pip install -q --python "$VPY" "${links[@]}" "$@"
  fi
}
if [[ -n "${BATON_JAX:-}" ]]; then
  # shellcheck disable=SC2206
  pins=(${BATON_JAX})
  if ! "$VPY" -m pip freeze 2>/dev/null | grep -qxF "${pins[0]}"; then
    log "installing ${pins[*]} (pinned)"
    py_install "${pins[@]}"
  fi
fi
if ((${#need[@]})); then
  log "installing Python packages: ${need[*]}"
  # shellcheck disable=SC2086
  py_install "${need[@]}" ${BATON_JAX:-}
fi

# --- 3. Baton itself ---------------------------------------------------------------
source_hash() {
  {
    if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
      git -C "$ROOT" ls-files --cached --others --exclude-standard -- \
        cpp python CMakeLists.txt pyproject.toml
    else
      find cpp python CMakeLists.txt pyproject.toml -type f ! -name '*.pyc'
    fi
  } | LC_ALL=C sort -u | while IFS= read -r f; do
    [[ -f "$f" ]] && printf '%s\n' "$f" && sha256sum <"$f"
  done | sha256sum | cut -d' ' -f1
}

mkdir -p "$STAMPS"
HASH="$(source_hash)"
STAMP="$STAMPS/baton-install${VNAME#.venv}"
installed_ok() {
  [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]] || return 1
  [[ -x "$VENV/bin/baton-plan" ]] || return 1
  compgen -G "$VENV/lib/python3*/site-packages/baton/_core*.so" >/dev/null
}
if [[ "${BATON_FORCE_INSTALL:-0}" == 1 ]] || ! installed_ok; then
  log "building and installing Baton into $VENV (build dir $BUILD_PY; first build takes minutes)"
  rm -f "$STAMP"
  # BATON_SETUP_CPP_TESTS=1 (scripts/test.sh sets it when it runs the C++ tests): the same
  # build also compiles the C++ tests, with -Werror, so the libraries compile once for both.
  tests=()
  [[ "${BATON_SETUP_CPP_TESTS:-0}" == 1 ]] &&
    tests=(-Ccmake.define.BATON_BUILD_TESTS=ON -Ccmake.define.BATON_WERROR=ON)
  "$VPY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
    -Cbuild-dir="$BUILD_PY" -Ccmake.define.BATON_BIND_PLANNER=ON \
    -Ccmake.define.BATON_BIND_GRAPH=ON -Ccmake.define.BATON_BIND_RUNTIME=ON "${tests[@]}" "$ROOT"
  echo "$HASH" >"$STAMP"
fi
log "ready: $VENV ($("$VPY" -V 2>&1), jax $("$VPY" -c 'import jax; print(jax.__version__)'))"
