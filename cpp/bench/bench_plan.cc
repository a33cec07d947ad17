// Planner throughput: generate + lower + verify + simulate, and each stage
// on its own. The headline case is interleaved 1F1B at p=64 ranks, v=2
// (128 stages), m=1024 microbatches. Timings are printed, never asserted.
//
//   cmake -S . -B build/rel -DBATON_BUILD_BENCH=ON -DCMAKE_BUILD_TYPE=Release
//   cmake --build build/rel --target bench_plan && build/rel/bench_plan
#include <benchmark/benchmark.h>

#include <exception>
#include <string>
#include <vector>

#include "baton/cost.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/sim.h"
#include "baton/verify.h"

namespace {

using namespace baton;

struct Case {
  std::string schedule;
  int p, m, v;
};

std::string label(const Case& c) {
  return c.schedule + "/p" + std::to_string(c.p) + "/m" + std::to_string(c.m) +
         (c.v > 1 ? "/v" + std::to_string(c.v) : "");
}

CostModel bench_costs() {
  CostModel c = CostModel::uniform(1.0, 2.0, 1.0, 1.0);
  c.default_stage.stash_bytes = 1 << 20;
  c.default_stage.act_bytes = 1 << 18;
  c.default_stage.grad_bytes = 1 << 18;
  c.link = {0.01, 1e8};
  return c;
}

void set_counters(benchmark::State& state, const Plan& plan) {
  size_t instrs = 0;
  for (const auto& p : plan.programs) instrs += p.size();
  state.counters["instrs"] = static_cast<double>(instrs);
  state.counters["instrs/s"] = benchmark::Counter(static_cast<double>(instrs) * state.iterations(),
                                                  benchmark::Counter::kIsRate);
}

// The case's schedule, or false (and the benchmark skipped) when the
// generator refuses it.
bool make(benchmark::State& state, const Case& c, Schedule& out) {
  try {
    out = make_schedule(c.schedule, c.p, c.m, c.v);
    return true;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return false;
  }
}

void BM_Generate(benchmark::State& state, Case c) {
  Schedule s;
  if (!make(state, c, s)) return;
  for (auto _ : state) benchmark::DoNotOptimize(make_schedule(c.schedule, c.p, c.m, c.v));
}

void BM_Lower(benchmark::State& state, Case c) {
  Schedule s;
  if (!make(state, c, s)) return;
  for (auto _ : state) benchmark::DoNotOptimize(lower(s));
  set_counters(state, lower(s));
}

void BM_Verify(benchmark::State& state, Case c) {
  Schedule s;
  if (!make(state, c, s)) return;
  const Plan plan = lower(s);
  for (auto _ : state) {
    VerifyReport r = verify(plan);
    if (!r.ok()) {
      state.SkipWithError(("plan does not verify: " + r.to_string()).c_str());
      break;
    }
    benchmark::DoNotOptimize(r);
  }
  set_counters(state, plan);
}

void BM_Simulate(benchmark::State& state, Case c) {
  Schedule s;
  if (!make(state, c, s)) return;
  const Plan plan = lower(s);
  const CostModel costs = bench_costs();
  for (auto _ : state) benchmark::DoNotOptimize(simulate(plan, costs));
  set_counters(state, plan);
}

void BM_Total(benchmark::State& state, Case c) {
  const CostModel costs = bench_costs();
  Schedule probe;
  if (!make(state, c, probe)) return;
  for (auto _ : state) {
    const Plan plan = lower(make_schedule(c.schedule, c.p, c.m, c.v));
    VerifyReport r = verify(plan);
    if (!r.ok()) {
      state.SkipWithError("plan does not verify");
      break;
    }
    benchmark::DoNotOptimize(simulate(plan, costs));
  }
}

const std::vector<Case>& cases() {
  static const std::vector<Case> kCases = {
      {"interleaved", 64, 1024, 2},  // the target: < 100 ms in total
      {"1f1b", 64, 1024, 1},        {"zbh1", 64, 1024, 1},     {"zbv", 64, 1024, 1},
      {"dualpipev", 64, 1024, 1},   {"interleaved", 8, 64, 2},  // a typical small run
  };
  return kCases;
}

int register_all() {
  for (const Case& c : cases()) {
    const std::string l = label(c);
    benchmark::RegisterBenchmark(("total/" + l).c_str(), BM_Total, c)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("generate/" + l).c_str(), BM_Generate, c)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("lower/" + l).c_str(), BM_Lower, c)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("verify/" + l).c_str(), BM_Verify, c)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("simulate/" + l).c_str(), BM_Simulate, c)
        ->Unit(benchmark::kMillisecond);
  }
  return 0;
}

const int kRegistered = register_all();

}  // namespace

BENCHMARK_MAIN();
