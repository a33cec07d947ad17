#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU (target: H200, Python 3.12, JAX 0.11.x CUDA 13,
# no network). Builds baton._core with the NCCL transport and the CUDA XLA FFI handlers, then:
#   a. the CUDA FFI handlers were built (_core.ffi.has_cuda()) and run on the GPU (baton_mark /
#      baton_drain against a 1-rank NcclRankComm, recording on) + tests/python/test_cuda_ffi.py;
#   b. a one-rank pipelined GPT step (baton.jit, 1-rank mesh) against the monolithic jax.jit of
#      the same step: ms/step of both, results equal to rtol 1e-5 (f32 matmuls at "highest"
#      precision in both, so TF32 rounding does not differ between the two programs);
#   c. two ranks over NCCL through the FFI path, one process with one GPU per rank (1F1B and
#      ZB-H1 GPT steps equal to jax.jit, ms/step): needs 2 GPUs (INFO otherwise);
#   d. an NCCL transport send/recv to self (one GPU can only be one rank);
#   e. single-GPU checks of the CUDA path (bench/gpu_check_single.py): a self link through the
#      FFI in a jitted fori_loop, a peer that never arrives, the implicit-sync probe, one libnccl;
#   f. pipe 2 x tensor 2 on 4 GPUs, equal to jax.jit (bench/gpu_check_pipe_tensor.py; INFO with
#      fewer GPUs).
# Every check FAILs when it cannot run what it claims (the build row too, when the CUDA path
# was not built).
# Prints a table. Usage, from the repository root:   bash bench/gpu_check.sh [python]
# Environment: BUILD_DIR (default build/gpu), JOBS (default nproc).
# Exit status: 0 when every check passed, 1 otherwise. Each step is bounded by `timeout`
# (about 8 minutes in all on an H200 machine, most of it the build).
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
row "nccl library" INFO "${BATON_NCCL_LIBRARY:-libnccl.so.2 from the loader path} (used only when JAX has not mapped one: Baton uses JAX's copy)"

# 2. Build --------------------------------------------------------------------------------
NB_DIR=$("$PY" -m nanobind --cmake_dir 2>/dev/null)
if [ -z "$NB_DIR" ]; then
  row "build" FAIL "nanobind is not installed for $PY (pip install nanobind)"
else
  T0=$(date +%s)
  if timeout 120 cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DBATON_BUILD_PYTHON=ON \
       -DBATON_BUILD_CLI=OFF -DBATON_BUILD_TESTS=OFF -DPython_EXECUTABLE="$(command -v "$PY")" \
       -Dnanobind_ROOT="$NB_DIR" >"$LOG/configure.txt" 2>&1 &&
     timeout 420 cmake --build "$BUILD_DIR" -j"$JOBS" --target _core >"$LOG/build.txt" 2>&1; then
    rm -rf "$STAGE" && mkdir -p "$STAGE" && cp -r python/baton "$STAGE/" &&
      cp "$BUILD_DIR"/_core*.so "$STAGE/baton/"
    NCCL_ON=$(grep -c "NCCL transport enabled" "$LOG/configure.txt")
    if [ "$NCCL_ON" -gt 0 ]; then
      row "build" PASS "$(( $(date +%s) - T0 )) s; $(grep -o 'NCCL transport enabled.*' "$LOG/configure.txt")"
    else  # built, but without the CUDA path: every GPU check below would test nothing
      row "build" FAIL "the CUDA path was NOT built: $(grep -o 'NCCL transport NOT built.*' "$LOG/configure.txt" | head -1) (see $LOG/configure.txt)"
    fi
  else
    row "build" FAIL "see $LOG/configure.txt and $LOG/build.txt: $(tail -3 "$LOG/build.txt" 2>/dev/null | tr '\n' ' ')"
  fi
fi
export PYTHONPATH="$PWD/$STAGE${PYTHONPATH:+:$PYTHONPATH}"

# 3a. CUDA FFI handlers --------------------------------------------------------------------
if [ -f "$STAGE/baton/__init__.py" ]; then
  FFI_OUT=$(timeout 180 "$PY" - <<'EOF' 2>&1
import tempfile
import jax, jax.numpy as jnp, numpy as np
from baton import _core
from baton.frontend import ffi
assert _core.ffi.has_cuda(), "built without the CUDA handlers (no CUDA/nccl.h at build time?)"
print("handlers:", ",".join(sorted(_core.ffi.handlers_cuda())))
assert jax.default_backend() == "gpu", jax.default_backend()
ffi.register()
store = _core.runtime.file_store(tempfile.mkdtemp())
c = _core.runtime.NcclRankComm(0, 1, 0, store, [], 30.0)  # no links: nothing to connect
c.record(True)

@jax.jit
def f(x):
    tok = jnp.zeros((), jnp.int32)
    tok = ffi.mark(c.id, 0, tok)
    y = jnp.sin(x) * 2
    tok = ffi.mark(c.id, 1, tok, (y,))
    tok = ffi.drain(c.id, tok)
    return y, tok

x = jnp.arange(1 << 20, dtype=jnp.float32)
for _ in range(3):
    y, tok = f(x)
jax.block_until_ready((y, tok))
np.testing.assert_allclose(np.asarray(y), np.sin(np.asarray(x)) * 2, rtol=1e-5, atol=1e-5)
marks = c.take_marks()
assert [p for p, _ in marks] == [0, 1] * 3, marks
assert all(t > 0 for _, t in marks), marks
assert c.failure() is None and c.alive
c.close()
print(f"ran: 3 calls, {len(marks)} marks, last task {(marks[-1][1] - marks[-2][1]) / 1e3:.1f} us")
EOF
)
  RC=$?
  if [ $RC -eq 0 ]; then
    row "cuda ffi handlers" PASS "$(echo "$FFI_OUT" | grep -E '^(handlers|ran):' | tr '\n' ' ')"
  else
    row "cuda ffi handlers" FAIL "rc=$RC $(echo "$FFI_OUT" | tail -4 | tr '\n' ' ')"
  fi
  timeout 240 "$PY" -m pytest -q -x -p no:cacheprovider tests/python/test_cuda_ffi.py \
    >"$LOG/pytest_cuda_ffi.txt" 2>&1
  RC=$?
  LAST=$(tail -1 "$LOG/pytest_cuda_ffi.txt")
  if [ $RC -eq 0 ]; then row "pytest test_cuda_ffi.py" PASS "$LAST"; else row "pytest test_cuda_ffi.py" FAIL "rc=$RC $LAST (see $LOG/pytest_cuda_ffi.txt)"; fi
fi

# 3e. Single-GPU checks of the CUDA path's first-contact hazards ---------------------------------
# One script, five rows: a self link through the FFI inside a jitted fori_loop (exact results,
# staging slots and CUDA events flat after the first step, time per unit); a peer that never
# arrives raising within the setup timeout (and the CUDA context usable after); the implicit-
# synchronization probe; a lax.switch unit against the same unit straight; one libnccl mapped.
if [ -f "$STAGE/baton/__init__.py" ]; then
  timeout 240 "$PY" bench/gpu_check_single.py >"$LOG/single_gpu.txt" 2>&1
  RC=$?
  for name in "self link (FFI, fori_loop)" "peer never arrives" "implicit sync probe" "switch vs straight" "one libnccl mapped"; do
    line=$(grep -F "ROW $name|" "$LOG/single_gpu.txt" | tail -1)
    if [ -z "$line" ]; then
      row "$name" FAIL "did not run (rc=$RC): $(tail -3 "$LOG/single_gpu.txt" | tr '\n' ' ')"
    else
      st=$(echo "$line" | cut -d'|' -f2); detail=$(echo "$line" | cut -d'|' -f3-)
      row "$name" "$st" "$detail"
    fi
  done
fi

# 3f. Pipe 2 x tensor 2 on 4 GPUs (ranks of several GPUs: one NCCL context per device slot) ------
NGPU4=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${NGPU4:-0}" -lt 4 ]; then
  row "pipe 2 x tensor 2 (NCCL)" INFO "needs 4 GPUs (found ${NGPU4:-0})"
elif [ -f "$STAGE/baton/__init__.py" ]; then
  timeout 300 "$PY" bench/gpu_check_pipe_tensor.py >"$LOG/pipe_tensor.txt" 2>&1
  RC=$?
  if [ $RC -eq 0 ]; then row "pipe 2 x tensor 2 (NCCL)" PASS "$(tail -1 "$LOG/pipe_tensor.txt")"
  else row "pipe 2 x tensor 2 (NCCL)" FAIL "rc=$RC $(tail -3 "$LOG/pipe_tensor.txt" | tr '\n' ' ')"; fi
fi

# 3b. One-rank pipelined GPT step vs monolithic jax.jit -------------------------------------
if [ -f "$STAGE/baton/__init__.py" ]; then
  GPT_OUT=$(PYTHONPATH="$PWD/examples:$PYTHONPATH" timeout 300 "$PY" - <<'EOF' 2>&1
import statistics, time
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np
import baton, gpt
assert jax.default_backend() == "gpu", jax.default_backend()
m, mb = 8, 8
cfg = gpt.GPTConfig(vocab=512, seq=128, dim=256, heads=4, layers=4, stages=1)
model, params, opt, opt_state, train_step, _ = gpt.make(cfg)
batch = gpt.synthetic_batch(cfg, mb * m)
base = jax.jit(gpt.scan_step(model, opt, m))
step = baton.jit(train_step, schedule=baton.OneFOneB(), microbatches=m,
                 mesh=baton.PipelineMesh(jax.devices()[:1], ranks=1))
want = jax.block_until_ready(base(params, opt_state, batch))
got = jax.block_until_ready(step(params, opt_state, batch))
la, lb = jax.tree.leaves(got), jax.tree.leaves(want)
assert len(la) == len(lb)
worst = 0.0
for a, b in zip(la, lb):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    worst = max(worst, float(np.max(np.abs(a - b) / (np.abs(b) + 1e-7), initial=0.0)))

def timed(fn, n=10):
    jax.block_until_ready(fn(params, opt_state, batch))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn(params, opt_state, batch))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3

tb, ts = timed(base), timed(step)
print(f"equal: rtol 1e-5 ({len(la)} arrays, worst rel {worst:.1e})")
print(f"time: jax.jit {tb:.2f} ms/step, baton 1 rank {ts:.2f} ms/step ({ts / tb:.2f}x); "
      f"GPT dim {cfg.dim} seq {cfg.seq} layers {cfg.layers}, {m} x {mb}")
EOF
)
  RC=$?
  if [ $RC -eq 0 ]; then
    row "one-rank GPT vs jax.jit" PASS "$(echo "$GPT_OUT" | grep '^equal:')"
    row "one-rank GPT ms/step" INFO "$(echo "$GPT_OUT" | grep '^time:')"
  else
    row "one-rank GPT vs jax.jit" FAIL "rc=$RC $(echo "$GPT_OUT" | tail -4 | tr '\n' ' ')"
  fi
fi

# 3c. Two ranks over NCCL through the FFI path (one process, one GPU per rank) ---------------
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${NGPU:-0}" -lt 2 ]; then
  row "two ranks over NCCL (FFI)" INFO "needs 2 GPUs (found ${NGPU:-0}): NCCL cannot connect two ranks on one GPU"
elif [ -f "$STAGE/baton/__init__.py" ]; then
  TWO_OUT=$(PYTHONPATH="$PWD/examples:$PYTHONPATH" timeout 300 "$PY" - <<'EOF' 2>&1
import statistics, time
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np
import baton, gpt
m, mb = 8, 8
cfg = gpt.GPTConfig(vocab=512, seq=128, dim=256, heads=4, layers=4, stages=2)
model, params, opt, opt_state, train_step, _ = gpt.make(cfg)
batch = gpt.synthetic_batch(cfg, mb * m)
base = jax.jit(gpt.scan_step(model, opt, m))
rows = []
for sched in (baton.OneFOneB(), baton.ZBH1()):
    step = baton.jit(train_step, schedule=sched, microbatches=m,
                     mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2), timeout=120)
    assert step.loop_transport() == "nccl", step.loop_transport()
    want = jax.block_until_ready(base(params, opt_state, batch))
    got = jax.block_until_ready(step(params, opt_state, batch))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=1e-5, atol=1e-7)
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(step(params, opt_state, batch))
        ts.append(time.perf_counter() - t)
    rows.append(f"{type(sched).__name__} {statistics.median(ts) * 1e3:.2f} ms/step")
print("two ranks: equal to jax.jit (rtol 1e-5); " + "; ".join(rows))
EOF
)
  RC=$?
  if [ $RC -eq 0 ]; then row "two ranks over NCCL (FFI)" PASS "$(echo "$TWO_OUT" | tail -1)"; else row "two ranks over NCCL (FFI)" FAIL "rc=$RC $(echo "$TWO_OUT" | tail -3 | tr '\n' ' ')"; fi
fi

# 3d. NCCL send/recv to self --------------------------------------------------------------
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

# 4. Table ---------------------------------------------------------------------------------
echo
printf '%-28s %-6s %s\n' "check" "status" "detail"
printf '%s\n' "----------------------------------------------------------------------------"
for r in "${ROWS[@]}"; do echo "$r"; done
exit $FAILED
