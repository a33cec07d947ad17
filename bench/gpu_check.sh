#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU (target: H200, Python 3.12, JAX 0.11.x CUDA 13,
# no network). Builds baton._core with the NCCL transport, runs the single-process pipeline
# tests on the GPU, does an NCCL send/recv to self (one GPU can only be one rank), and prints a
# table. Usage, from the repository root:   bash bench/gpu_check.sh [python]
# Environment: BUILD_DIR (default build/gpu), JOBS (default nproc), PYTEST_ARGS.
# Exit status: 0 when every check passed, 1 otherwise. Each step is bounded by `timeout`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PYTHON:-python3}}
BUILD_DIR=${BUILD_DIR:-build/gpu}
JOBS=${JOBS:-$(nproc)}
STAGE="$BUILD_DIR/stage"
LOG="$BUILD_DIR/logs"
mkdir -p "$LOG"
declare -a ROWS=()
FAILED=0
row() {  # name status detail
  ROWS+=("$(printf '%-28s %-6s %s' "$1" "$2" "$3")")
  [ "$2" = "PASS" ] || [ "$2" = "INFO" ] || FAILED=1
}

# 1. Environment --------------------------------------------------------------------------
ENV_OUT=$(timeout 120 "$PY" - <<'EOF' 2>&1
import sys, jax
devs = jax.devices()
print(f"python {sys.version.split()[0]}, jax {jax.__version__}, backend {jax.default_backend()}, "
      f"{len(devs)} x {devs[0].device_kind}")
EOF
)
if [ $? -eq 0 ]; then row "environment" INFO "$ENV_OUT"; else row "environment" FAIL "$ENV_OUT"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  | head -1 | { read -r l && row "nvidia-smi" INFO "$l"; } || true

# The NCCL that JAX's CUDA plugin uses (nvidia-nccl-cu13 wheel), so there is one copy.
NCCL_LIB=$(timeout 60 "$PY" - <<'EOF' 2>/dev/null
import glob, os
try:
    import nvidia.nccl as n
    roots = list(n.__path__)
except Exception:
    roots = []
for r in roots:
    for f in glob.glob(os.path.join(r, "lib", "libnccl.so*")):
        print(f); raise SystemExit
EOF
)
[ -n "$NCCL_LIB" ] && export BATON_NCCL_LIBRARY="$NCCL_LIB"
row "nccl library" INFO "${BATON_NCCL_LIBRARY:-libnccl.so.2 from the loader path}"

# 2. Build --------------------------------------------------------------------------------
NB_DIR=$("$PY" -m nanobind --cmake_dir 2>/dev/null)
if [ -z "$NB_DIR" ]; then
  row "build" FAIL "nanobind is not installed for $PY (pip install nanobind)"
else
  T0=$(date +%s)
  if timeout 900 cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DBATON_BUILD_PYTHON=ON \
       -DBATON_BUILD_CLI=OFF -DBATON_BUILD_TESTS=OFF -DPython_EXECUTABLE="$(command -v "$PY")" \
       -Dnanobind_ROOT="$NB_DIR" >"$LOG/configure.txt" 2>&1 &&
     timeout 900 cmake --build "$BUILD_DIR" -j"$JOBS" --target _core >"$LOG/build.txt" 2>&1; then
    rm -rf "$STAGE" && mkdir -p "$STAGE" && cp -r python/baton "$STAGE/" &&
      cp "$BUILD_DIR"/_core*.so "$STAGE/baton/"
    NCCL_ON=$(grep -c "NCCL transport enabled" "$LOG/configure.txt")
    row "build" PASS "$(( $(date +%s) - T0 )) s, NCCL transport compiled: $([ "$NCCL_ON" -gt 0 ] && echo yes || echo NO)"
  else
    row "build" FAIL "see $LOG/configure.txt and $LOG/build.txt: $(tail -3 "$LOG/build.txt" 2>/dev/null | tr '\n' ' ')"
  fi
fi
export PYTHONPATH="$PWD/$STAGE${PYTHONPATH:+:$PYTHONPATH}"

# 3. Single-process pipeline tests on the GPU ---------------------------------------------
if [ -f "$STAGE/baton/__init__.py" ]; then
  TESTS=""
  for f in tests/python/test_runtime.py tests/python/test_e2e.py tests/python/test_frontend.py; do
    [ -f "$f" ] && TESTS="$TESTS $f"
  done
  # shellcheck disable=SC2086
  timeout 600 "$PY" -m pytest -q -x -p no:cacheprovider $TESTS ${PYTEST_ARGS:-} \
    >"$LOG/pytest.txt" 2>&1
  RC=$?
  LAST=$(tail -1 "$LOG/pytest.txt")
  if [ $RC -eq 0 ]; then row "pytest (GPU backend)" PASS "$LAST"; else row "pytest (GPU backend)" FAIL "rc=$RC $LAST (see $LOG/pytest.txt)"; fi
fi

# 4. NCCL send/recv to self ---------------------------------------------------------------
if [ -f "$STAGE/baton/__init__.py" ]; then
  NCCL_OUT=$(timeout 300 "$PY" - <<'EOF' 2>&1
import tempfile, time
import jax, jax.numpy as jnp, numpy as np
from baton import runtime as rt
assert rt.nccl_available(), "NCCL could not be loaded (set BATON_NCCL_LIBRARY)"
store = rt.file_store(tempfile.mkdtemp())
t = rt.nccl_transport(0, 1, 0, store)
# correctness: several dtypes, one group (send and receive to self must share a group)
xs = [jnp.arange(1000, dtype=d) for d in (jnp.float32, jnp.bfloat16, jnp.int32, jnp.float16)]
rr = t.irecv(0, 1, layout=xs); rs = t.isend(0, 1, xs); t.flush()
ys = rr.wait(60); rs.wait(60)
for x, y in zip(xs, ys):
    assert y.dtype == x.dtype and y.shape == x.shape, (x.dtype, y.dtype)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
print("correct: float32 bfloat16 int32 float16")
rows = []
for mb in (1, 16, 256):
    x = jnp.ones((mb * 1024 * 1024 // 4,), jnp.float32); x.block_until_ready()
    for _ in range(2):
        rr = t.irecv(0, 2, layout=[x]); rs = t.isend(0, 2, [x]); t.flush(); rr.wait(60); rs.wait(60)
    n = 5; t0 = time.perf_counter()
    for i in range(n):
        rr = t.irecv(0, 3 + i, layout=[x]); rs = t.isend(0, 3 + i, [x]); t.flush()
        y = rr.wait(60); rs.wait(60)
    y[0].block_until_ready()
    dt = (time.perf_counter() - t0) / n
    rows.append(f"{mb} MiB {dt*1e3:.2f} ms {mb / 1024 / dt:.1f} GiB/s")
print("self-transfer: " + "; ".join(rows))
t.close()
EOF
)
  if [ $? -eq 0 ]; then
    row "nccl send/recv to self" PASS "$(echo "$NCCL_OUT" | grep correct)"
    row "nccl self bandwidth" INFO "$(echo "$NCCL_OUT" | grep self-transfer)"
  else
    row "nccl send/recv to self" FAIL "$(echo "$NCCL_OUT" | tail -4 | tr '\n' ' ')"
  fi
fi

# 5. Table --------------------------------------------------------------------------------
echo
printf '%-28s %-6s %s\n' "check" "status" "detail"
printf '%s\n' "----------------------------------------------------------------------------"
for r in "${ROWS[@]}"; do echo "$r"; done
exit $FAILED
