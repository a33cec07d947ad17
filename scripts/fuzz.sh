#!/usr/bin/env bash
# Builds the libFuzzer targets (cpp/fuzz, clang with ASan + UBSan, build/fuzz)
# and runs each for a fixed time from its committed seed corpus, then replays
# the corpus and the regression inputs (ctest). Exits non-zero on any finding;
# libFuzzer writes the failing input as build/fuzz/findings/<target>/crash-*
# (add it to cpp/fuzz/regressions/<target>/ once fixed).
#
#   bash scripts/fuzz.sh            # 45 s per target
#   bash scripts/fuzz.sh 300        # 300 s per target
#   bash scripts/fuzz.sh 60 wire_meta cost_json   # only these targets
#
# Needs clang and libFuzzer's runtime (Debian: clang, libclang-rt-<version>-dev);
# installs them with apt-get when they are missing and this runs as root.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECONDS_PER_TARGET="${1:-45}"
shift || true
BUILD=build/fuzz
log() { echo "[fuzz] $*" >&2; }

# A clang that links -fsanitize=fuzzer, or none.
probe() {
  local dir
  dir="$(mktemp -d)"
  printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' \
    >"$dir/p.cc"
  clang++ -fsanitize=fuzzer,address,undefined "$dir/p.cc" -o "$dir/p" >/dev/null 2>&1
  local rc=$?
  rm -rf "$dir"
  return $rc
}
if ! probe; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    log "installing clang and libFuzzer's runtime (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang \
      "libclang-rt-$(clang --version 2>/dev/null | sed -n 's/.*version \([0-9]*\).*/\1/p' | head -1)-dev" \
      >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libclang-rt-dev >/dev/null
  fi
  probe || { log "clang++ cannot link -fsanitize=fuzzer (install clang and libclang-rt-*-dev)"; exit 1; }
fi

log "configure + build ($BUILD, clang, ASan + UBSan + libFuzzer)"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DBATON_FUZZ=ON -DBATON_WERROR=ON -DBATON_BUILD_CLI=OFF -DBATON_BUILD_TESTS=OFF \
  -DBATON_WITH_NCCL=OFF >/dev/null || exit 1
cmake --build "$BUILD" -j"${BATON_JOBS:-2}" || exit 1

targets=("$@")
if ((${#targets[@]} == 0)); then
  mapfile -t targets < <(sed -n '/^set(BATON_FUZZ_TARGETS/,/)/p' cpp/fuzz/CMakeLists.txt |
    tr '() ' '\n\n\n' | grep -v -e '^set$' -e '^BATON_FUZZ_TARGETS$' -e '^$')
fi
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
failed=()
for t in "${targets[@]}"; do
  out="$BUILD/findings/$t"
  work="$BUILD/corpus/$t"  # new inputs go here, the committed corpus stays as it is
  mkdir -p "$out" "$work"
  log "$t: ${SECONDS_PER_TARGET} s"
  if ! "$BUILD/cpp/fuzz/fuzz_$t" -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 \
       -max_len=8192 -timeout=10 -print_final_stats=1 -artifact_prefix="$out/" \
       "$work" "cpp/fuzz/corpus/$t" >"$out/log" 2>&1; then
    failed+=("$t")
    log "$t FAILED; input(s): $(ls "$out" | grep -v '^log$' | tr '\n' ' '); tail of $out/log:"
    tail -n 30 "$out/log" >&2
  else
    grep -E '^stat::number_of_executed_units|^#[0-9]+.*DONE' "$out/log" | tail -n 2 >&2
  fi
done
log "replaying the corpus and the regression inputs (ctest)"
(cd "$BUILD" && ctest --output-on-failure -R '^fuzz_replay_') || failed+=("replay")
if ((${#failed[@]})); then log "FAILED: ${failed[*]}"; exit 1; fi
log "all targets ran ${SECONDS_PER_TARGET} s without a finding"
