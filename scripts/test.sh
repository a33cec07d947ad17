#!/usr/bin/env bash
# Runs every Baton test: sets up (scripts/setup.sh), builds and runs the C++ tests
# (ctest, in setup's build directory build/py, -Werror), then the Python tests (pytest).
# Exits non-zero if anything fails.
#
#   bash scripts/test.sh                 # the C++ tests, then every Python test but the
#                                        # ones marked `heavy` (pyproject.toml's markers)
#   bash scripts/test.sh --all           # the same, and the `heavy` cases too (.ci/run
#                                        # runs them as its own pass)
#   bash scripts/test.sh --cpp-only      # C++ tests only
#   bash scripts/test.sh --py-only       # Python tests only
#   bash scripts/test.sh --py-only --jax-oldest      # Python tests against the oldest JAX
#                                        # Baton supports (its own venv, .venv-jax-oldest)
#   bash scripts/test.sh --py-only -- -k planner   # arguments after -- go to pytest
#                                        # (default: the testpaths of pyproject.toml, less
#                                        # `heavy` unless --all; given arguments replace it)
#   bash scripts/test.sh --maxtext       # MaxText as a Baton client: sets up .venv-maxtext
#                                        # (scripts/setup_maxtext.sh), runs tests/python/test_maxtext.py
#   BATON_SANITIZE=1 bash scripts/test.sh --cpp-only   # ASan+UBSan build in build/asan
#
# Environment: BATON_JOBS (build parallelism, default 2), BATON_PYTEST_TIMEOUT (seconds
# for the whole pytest run, default 2700), BATON_PYTEST_WORKERS (pytest-xdist processes,
# default 3; 0 runs in one process), BATON_JAX_CACHE (0: no persistent compilation cache;
# default on, in .cache/jax), BATON_TEST_XLA_OPT (0, the default: the tests compile with XLA's
# optimizations off, JAX_DISABLE_MOST_OPTIMIZATIONS=1 and JAX_OPTIMIZATION_LEVEL=O0; 1: XLA's
# default optimizations, as users run), BATON_TEST_CASE_TIMEOUT (seconds one Python case may
# take, default 600). A skip whose reason tests/python/skip_policy.py does not list fails the run.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

run_cpp=1
run_py=1
run_maxtext=0
run_heavy=0
pytest_args=()
while (($#)); do
  case "$1" in
    --cpp-only) run_py=0 ;;
    --py-only) run_cpp=0 ;;
    --maxtext) run_cpp=0; run_maxtext=1 ;;
    --all) run_heavy=1 ;;
    --jax-oldest)
      # The oldest JAX Baton supports (README "Requirements"); the newest is what pip picks.
      export BATON_VENV=.venv-jax-oldest BATON_JAX="jax==0.11.0 jaxlib==0.11.0" ;;
    --) shift; pytest_args=("$@"); break ;;
    *) echo "usage: $0 [--cpp-only | --py-only | --maxtext] [--all] [--jax-oldest] [-- pytest args]" >&2
       exit 64 ;;
  esac
  shift
done

JOBS="${BATON_JOBS:-2}"
# each line carries the seconds since the command started (where the time goes)
log() { echo "[test ${SECONDS}s] $*" >&2; }

if ((run_maxtext)); then
  export BATON_VENV=.venv-maxtext
  bash scripts/setup_maxtext.sh || { log "MaxText setup failed"; exit 1; }
  ((${#pytest_args[@]})) || pytest_args=(tests/python/test_maxtext.py)
  export BATON_PYTEST_WORKERS="${BATON_PYTEST_WORKERS:-0}"
else
  # With the C++ tests to run, setup's build compiles them too (one build of the libraries).
  ((run_cpp)) && [[ "${BATON_SANITIZE:-0}" != 1 ]] && export BATON_SETUP_CPP_TESTS=1
  bash scripts/setup.sh || { log "setup failed"; exit 1; }
fi

failed=()

if ((run_cpp)); then
  if [[ "${BATON_SANITIZE:-0}" == 1 ]]; then
    BUILD="build/asan"
    cfg=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DBATON_SANITIZE=ON)
    export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}"
    export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
  else
    # setup's build directory (scripts/setup.sh: build/py, or build/py-<name> for BATON_VENV)
    vname="$(basename "${BATON_VENV:-.venv}")"
    BUILD="build/py"
    [[ "$vname" == ".venv" ]] || BUILD="build/py-${vname#.}"
    cfg=(-DCMAKE_BUILD_TYPE=Release)
  fi
  log "C++: configure + build ($BUILD)"
  if cmake -S . -B "$BUILD" -DBATON_BUILD_TESTS=ON -DBATON_WERROR=ON -DBATON_BUILD_CLI=ON \
       "${cfg[@]}" >/dev/null; then
    if cmake --build "$BUILD" -j"$JOBS"; then
      # Without an NVIDIA device NcclComm's construction must fail (clearly): tell the
      # test so, so that it cannot pass both ways (test_runtime_nccl_comm.cc).
      if [[ -z "${BATON_EXPECT_NO_GPU+x}" ]] && ! compgen -G '/dev/nvidia[0-9]*' >/dev/null &&
         ! nvidia-smi -L >/dev/null 2>&1; then
        export BATON_EXPECT_NO_GPU=1
        log "no NVIDIA device: BATON_EXPECT_NO_GPU=1 (NCCL construction must fail clearly)"
      fi
      log "C++: ctest"
      ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS" || failed+=("ctest")
    else
      failed+=("C++ build")
    fi
  else
    failed+=("C++ configure")
  fi
fi

if ((run_py)); then
  log "Python: pytest"
  export JAX_NUM_CPU_DEVICES="${JAX_NUM_CPU_DEVICES:-8}"
  VENV="$ROOT/${BATON_VENV:-.venv}"
  export PATH="$VENV/bin:$PATH"
  workers=()
  # worksteal: a worker that runs out of cases takes queued ones from the others, so a long
  # case queued last does not leave a core idle at the end. Three workers on two cores: the
  # cases that launch processes spend part of their time waiting (start-up, rendezvous), so a
  # third worker fills it (2026-12-05, 2 cores, empty compilation cache: 483 s with 2, 439 s
  # with 3).
  ((${BATON_PYTEST_WORKERS:-3} > 0)) && workers=(-n "${BATON_PYTEST_WORKERS:-3}" --dist worksteal)
  # Without arguments: every test but the `heavy` cases (each a costly case whose code path a
  # lighter case also runs: more processes, more devices, more schedules); --all runs them
  # too (.ci/run does, as a pass of its own). Times: bench/results/test_time.md.
  if ((${#pytest_args[@]} == 0 && ! run_heavy)); then
    pytest_args=(-m "not heavy")
    log "leaving out the cases marked heavy (--all runs them)"
  fi
  # JAX's persistent compilation cache, shared by the pytest workers and the processes the
  # tests launch (compiling is most of the tests' time; a second run reuses it; its keys
  # hold the JAX version and the program). BATON_JAX_CACHE=0 turns it off.
  if [[ "${BATON_JAX_CACHE:-1}" != 0 ]]; then
    export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$ROOT/.cache/jax}"
    export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
    export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
    # a size limit turns on JAX's file lock around every read and write (without it a
    # reader can meet an entry another process is still writing: a warning, a recompile)
    export JAX_COMPILATION_CACHE_MAX_SIZE="${JAX_COMPILATION_CACHE_MAX_SIZE:-4294967296}"
    log "JAX compilation cache: $JAX_COMPILATION_CACHE_DIR"
  fi
  # The tests check behaviour (every pipelined result against plain JAX compiled with the same
  # flags, not wall-clock times), and compiling is most of their time: by default XLA
  # compiles them with its optimizations off (LLVM at -O0 without its expensive passes, XLA's
  # optimization effort O0), about half the compile time. The processes the tests launch inherit it. BATON_TEST_XLA_OPT=1 compiles
  # with XLA's defaults (.ci/run's oldest-JAX pass does).
  if [[ "${BATON_TEST_XLA_OPT:-0}" == 0 ]]; then
    export JAX_DISABLE_MOST_OPTIMIZATIONS=1 JAX_OPTIMIZATION_LEVEL=O0
    log "XLA optimizations off for the tests (BATON_TEST_XLA_OPT=1 turns them on)"
  fi
  # Skips: -rs prints every skip's reason; the plugin tests/python/skip_policy.py (its
  # EXPECTED, the one list of skip reasons a run may have: no CUDA device, CUDA not built, ...)
  # fails the run on any other skip, so a case that needs what this harness provides (eight
  # CPU devices, ...) fails instead of skipping. A hang names itself: pytest-timeout stops a
  # case after BATON_TEST_CASE_TIMEOUT seconds (default 600) and prints every thread's stack
  # (thread method: it also ends a case blocked in C++; under xdist the worker is replaced and
  # the case reported as failed).
  export PYTHONPATH="$ROOT/tests/python${PYTHONPATH:+:$PYTHONPATH}"
  policy=(-rs -p skip_policy --timeout="${BATON_TEST_CASE_TIMEOUT:-600}" --timeout-method=thread)
  # pytest exits 5 when it collects nothing: that is a failure here too. --durations: the
  # slowest cases in the log, where the suite's time goes.
  timeout --kill-after=30 "${BATON_PYTEST_TIMEOUT:-2700}" \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 "${workers[@]}" \
    "${policy[@]}" "${pytest_args[@]}"
  rc=$?
  if ((rc == 124 || rc == 137)); then
    log "pytest timed out after ${BATON_PYTEST_TIMEOUT:-2700}s"
    failed+=("pytest (timeout)")
  elif ((rc != 0)); then
    failed+=("pytest (exit $rc)")
  fi
fi

if ((${#failed[@]})); then
  log "FAILED: ${failed[*]}"
  exit 1
fi
log "all tests passed"
