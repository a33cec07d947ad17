// Runtime tests: executor over every schedule with fake tasks, in-process and
// Gloo transports, overlap, failure propagation, timeouts and the handshake.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "baton/generators.h"
#include "baton/rank_program.h"
#include "baton/runtime.h"
#include "baton/verify.h"

namespace baton::runtime {
namespace {

using namespace std::chrono_literals;

struct Num : ValueBase {
  explicit Num(double v) : x(v) {}
  size_t nbytes() const override { return 8; }
  double x;
};
Value num(double x) { return std::make_shared<Num>(x); }
double get(const Value& v) { return dynamic_cast<Num&>(*v).x; }

double base(int m) { return 1.0 + m; }

// Fake tasks: F(s,m): act = in + 1, stash = in (in = base(m) on stage 0);
// B/I(s,m): grad = 2 g, wgrad|wstash = stash * g (g = 1 on the last stage);
// W: wgrad = wstash. Accumulators sum wgrad per stage.
class FakeTasks : public Tasks {
 public:
  FakeTasks(const Plan& plan, std::chrono::milliseconds work = 0ms) : plan_(plan), work_(work) {}
  std::vector<Value> run(const TaskCall& c) override {
    if (runs_++ == fail_at) throw std::runtime_error("injected failure");
    if (work_.count() > 0) std::this_thread::sleep_for(work_);
    std::map<int32_t, double> env;
    for (size_t i = 0; i < c.inputs.size(); ++i) env[(*c.input_ids)[i]] = get(c.inputs[i]);
    const int S = plan_.schedule.num_stages;
    auto id = [&](BufKind k, int s, int m) { return plan_.buffer_id({k, s, m}); };
    std::vector<Task> tasks{c.act->first};
    if (c.act->is_fused()) tasks.push_back(c.act->second);
    for (const Task& t : tasks) {
      const int s = t.stage, m = t.microbatch;
      if (t.kind == TaskKind::F) {
        const double in = s == 0 ? base(m) : env.at(id(BufKind::Act, s - 1, m));
        if (s < S - 1) env[id(BufKind::Act, s, m)] = in + 1;
        env[id(BufKind::Stash, s, m)] = in;
      } else if (t.kind == TaskKind::W) {
        env[id(BufKind::WGrad, s, m)] = env.at(id(BufKind::WStash, s, m));
      } else {
        const double g = s == S - 1 ? 1.0 : env.at(id(BufKind::Grad, s + 1, m));
        const double st = env.at(id(BufKind::Stash, s, m));
        if (s > 0) env[id(BufKind::Grad, s, m)] = 2 * g;
        env[id(t.kind == TaskKind::B ? BufKind::WGrad : BufKind::WStash, s, m)] = st * g;
      }
    }
    std::vector<Value> out;
    for (int32_t b : *c.output_ids) out.push_back(num(env.at(b)));
    return out;
  }
  void accumulate(int, int32_t buffer, const Value& v) override {
    acc[plan_.buffer_key(buffer).stage] += get(v);
  }
  // Byte transports: a Num crosses as one float64 scalar tensor.
  Payload to_payload(const Value& v) override {
    Tensor t = alloc_host_tensor(DType::F64, {});
    const double x = get(v);
    std::memcpy(t.data, &x, 8);
    return {t};
  }
  Value from_payload(Payload p) override {
    double x;
    std::memcpy(&x, p.at(0).data, 8);
    return num(x);
  }
  // With `known_layout`, every buffer is declared a float64 scalar (byte
  // transports then send no header).
  Layout recv_layout(int, int32_t) override {
    if (!known_layout) return {};
    ++layout_calls;
    return {TensorSpec{DType::F64, {}}};
  }
  std::map<int, double> acc;
  bool known_layout = false;
  int layout_calls = 0;
  int fail_at = -1;  // index of the RUN (counted on this rank) that throws
  int runs_ = 0;

 private:
  const Plan& plan_;
  std::chrono::milliseconds work_;
};

double expected_acc(const Schedule& s, int stage) {
  double sum = 0;
  const int S = s.num_stages;
  for (int m = 0; m < s.num_microbatches; ++m)
    sum += (base(m) + stage) * std::pow(2.0, S - 1 - stage);
  return sum;
}

// Runs `steps` steps of `plan` on one thread per rank; returns per-rank errors.
std::vector<std::string> run_ranks(const RankIR& ir, std::vector<std::unique_ptr<Transport>>& tr,
                                   std::vector<std::unique_ptr<FakeTasks>>& tasks, int steps,
                                   ExecutorOptions opts = {},
                                   std::vector<std::vector<Event>>* events = nullptr) {
  const int p = ir.plan.schedule.num_ranks;
  std::vector<std::string> errors(static_cast<size_t>(p));
  if (events) events->assign(static_cast<size_t>(p), {});
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      try {
        Executor ex(ir, r, *tr[static_cast<size_t>(r)], *tasks[static_cast<size_t>(r)], opts);
        ex.handshake(5s);
        for (int i = 0; i < steps; ++i) ex.run();
        if (events) (*events)[static_cast<size_t>(r)] = ex.events();
        EXPECT_GT(ex.stats().peak_live_buffers, 0);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

std::vector<std::unique_ptr<FakeTasks>> make_tasks(const Plan& plan,
                                                   std::chrono::milliseconds w = 0ms) {
  std::vector<std::unique_ptr<FakeTasks>> t;
  for (int r = 0; r < plan.schedule.num_ranks; ++r)
    t.push_back(std::make_unique<FakeTasks>(plan, w));
  return t;
}

std::vector<std::unique_ptr<Transport>> local_transports(int p, TransportOptions o = {}) {
  auto hub = LocalHub::create(p, o);
  std::vector<std::unique_ptr<Transport>> tr;
  for (int r = 0; r < p; ++r) tr.push_back(hub->transport(r));
  return tr;
}

std::vector<std::unique_ptr<Transport>> gloo_transports(int p, GlooOptions o = {}) {
  auto store = make_hash_store();
  std::vector<std::unique_ptr<Transport>> tr(static_cast<size_t>(p));
  std::vector<std::thread> th;
  for (int r = 0; r < p; ++r)
    th.emplace_back([&, r] { tr[static_cast<size_t>(r)] = make_gloo_transport(r, p, store, o); });
  for (auto& t : th) t.join();
  return tr;
}

void check_results(const Plan& plan, std::vector<std::unique_ptr<FakeTasks>>& tasks, int steps,
                   const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  const Schedule& s = plan.schedule;
  for (int st = 0; st < s.num_stages; ++st) {
    auto& t = *tasks[static_cast<size_t>(s.stage_rank[static_cast<size_t>(st)])];
    EXPECT_DOUBLE_EQ(t.acc[st], steps * expected_acc(s, st)) << s.name << " stage " << st;
  }
}

struct Case {
  std::string name;
  int p, m, v;
};
std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& n : schedule_names()) {
    const int v = n == "interleaved" ? 2 : 1;
    out.push_back({n, 2, 4, v});
    out.push_back({n, 3, 6, v});
  }
  return out;
}

TEST(RuntimeLocal, EverySchedule) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(fmt::format("{} p={} m={}", c.name, c.p, c.m));
    const Plan plan = lower(make_schedule(c.name, c.p, c.m, c.v));
    ASSERT_TRUE(verify(plan).ok());
    auto tr = local_transports(c.p);
    auto tasks = make_tasks(plan);
    check_results(plan, tasks, 2, run_ranks(build_rank_ir(plan), tr, tasks, 2));
  }
}

TEST(RuntimeGloo, EveryScheduleBetweenThreads) {
  for (const Case& c : cases()) {
    if (c.p != 2 && c.name != "1f1b" && c.name != "zbv") continue;  // keep it quick
    SCOPED_TRACE(fmt::format("{} p={} m={}", c.name, c.p, c.m));
    const Plan plan = lower(make_schedule(c.name, c.p, c.m, c.v));
    auto tr = gloo_transports(c.p);
    auto tasks = make_tasks(plan);
    check_results(plan, tasks, 2, run_ranks(build_rank_ir(plan), tr, tasks, 2));
  }
}

TEST(RuntimeGloo, KnownLayoutsRunSchedulesAndAreAskedOncePerBuffer) {
  for (const char* name : {"1f1b", "zbv", "dualpipev"}) {
    SCOPED_TRACE(name);
    const Plan plan = lower(make_schedule(name, 2, 4, 1));
    auto tr = gloo_transports(2);
    auto tasks = make_tasks(plan);
    for (auto& t : tasks) t->known_layout = true;
    check_results(plan, tasks, 3, run_ranks(build_rank_ir(plan), tr, tasks, 3));
    // Asked once per buffer crossing ranks (each rank asks for what it sends
    // and what it receives), not once per transfer of the 3 steps.
    int crossing = 0;
    for (const auto& prog : plan.programs)
      for (const Instr& in : prog) crossing += in.op == OpCode::Send;
    EXPECT_EQ(tasks[0]->layout_calls + tasks[1]->layout_calls, 2 * crossing);
  }
}

// Tasks for raw transfers of host values (the default conversions only).
struct NoTasks : Tasks {
  std::vector<Value> run(const TaskCall&) override { return {}; }
  void accumulate(int, int32_t, const Value&) override {}
};

// Every dtype crosses, with a header (layout unknown) and without one (the
// receiver knows the layout; here the send is posted first).
void dtypes_cross(bool known_layout) {
  auto tr = gloo_transports(2);
  Payload sent;
  const DType dtypes[] = {DType::F32, DType::BF16, DType::F16,  DType::I32,
                          DType::I64, DType::U8,   DType::Bool, DType::F64};
  int k = 0;
  for (DType d : dtypes) {
    Tensor t = alloc_host_tensor(d, {3, k + 1});
    for (size_t i = 0; i < t.nbytes; ++i)
      static_cast<unsigned char*>(t.data)[i] = static_cast<unsigned char>(i * 7 + k);
    sent.push_back(t);
    ++k;
  }
  sent.push_back(alloc_host_tensor(DType::F32, {0, 5}));  // empty
  NoTasks conv;
  Layout layout;
  if (known_layout)
    for (const Tensor& t : sent) layout.push_back({t.dtype, t.shape});
  RequestPtr rr, rs;
  if (known_layout) {
    rs = tr[0]->isend(1, 42, std::make_shared<HostValue>(sent), "test", &conv, 0, layout);
    rr = tr[1]->irecv(0, 42, "test", &conv, 0, layout);
  } else {
    rr = tr[1]->irecv(0, 42, "test", &conv);
    rs = tr[0]->isend(1, 42, std::make_shared<HostValue>(sent), "test", &conv);
  }
  ASSERT_TRUE(rr->wait_until(Clock::now() + 10s));
  ASSERT_TRUE(rs->wait_until(Clock::now() + 10s));
  rr->check();
  rs->check();
  auto got = std::dynamic_pointer_cast<HostValue>(rr->take_value());
  ASSERT_TRUE(got);
  ASSERT_EQ(got->tensors.size(), sent.size());
  for (size_t i = 0; i < sent.size(); ++i) {
    const Tensor& a = sent[i];
    const Tensor& b = got->tensors[i];
    EXPECT_EQ(a.dtype, b.dtype);
    EXPECT_EQ(a.shape, b.shape);
    ASSERT_EQ(a.nbytes, b.nbytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data) % 64, 0u);
    EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes), 0) << dtype_name(a.dtype);
  }
}

TEST(RuntimeGloo, TensorsOfEveryDtypeCross) { dtypes_cross(false); }
TEST(RuntimeGloo, TensorsOfEveryDtypeCrossWithoutHeader) { dtypes_cross(true); }

TEST(RuntimeGloo, ValueNotMatchingTheReceiversLayoutFailsBothSides) {
  auto tr = gloo_transports(2);
  NoTasks conv;
  const Layout want{{DType::F32, {4, 8}}};
  auto rr = tr[1]->irecv(0, 7, "act(s0,m3)", &conv, 0, want);
  Payload sent{alloc_host_tensor(DType::F32, {4, 9})};
  auto rs = tr[0]->isend(1, 7, std::make_shared<HostValue>(sent), "act(s0,m3)", &conv, 0, want);
  ASSERT_TRUE(rs->wait_until(Clock::now() + 10s));
  try {
    rs->check();
    FAIL() << "a mismatched send succeeded";
  } catch (const ExecutionError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("act(s0,m3)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("float32[4,9]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expects [float32[4,8]]"), std::string::npos) << msg;
  }
  // What the executor does with a failed request: abort, which reaches the peer.
  tr[0]->abort("send failed");
  ASSERT_TRUE(rr->wait_until(Clock::now() + 10s));
  EXPECT_THROW(rr->check(), ExecutionError);
}

TEST(Runtime, DtypeNames) {
  EXPECT_EQ(dtype_from_name("bfloat16"), DType::BF16);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  try {
    dtype_from_name("complex64");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("unsupported dtype 'complex64'"), std::string::npos);
  }
}

// With a slow transfer, rank 0 keeps computing F0.1 while act(s0,m0) is still
// in flight.
TEST(RuntimeLocal, ComputeOverlapsSlowTransfer) {
  const Plan plan = lower(make_schedule("gpipe", 2, 4));
  TransportOptions o;
  // 1 s (was 0.3 s): F0.1's 20 ms must fit inside the delayed send even when a
  // loaded 2-core machine stalls a thread for a few hundred ms.
  o.delay = 1000ms;
  auto tr = local_transports(2, o);
  auto tasks = make_tasks(plan, 20ms);
  ExecutorOptions eo;
  eo.record_events = true;
  std::vector<std::vector<Event>> ev;
  auto errors = run_ranks(build_rank_ir(plan), tr, tasks, 1, eo, &ev);
  check_results(plan, tasks, 1, errors);
  const Event* send0 = nullptr;
  const Event* run1 = nullptr;
  for (const Event& e : ev[0]) {
    const std::string d = plan.describe(0, e.instr);
    if (d.find("SEND act(s0,m0)") != std::string::npos) send0 = &e;
    if (d.find("RUN F0.1") != std::string::npos) run1 = &e;
  }
  ASSERT_TRUE(send0 && run1);
  EXPECT_GE(send0->completed - send0->posted, 990ms);  // the transfer really was slow
  EXPECT_LT(run1->completed, send0->completed);        // F0.1 ran meanwhile
  EXPECT_GT(run1->started, send0->posted);
}

TEST(RuntimeLocal, TaskFailureStopsEveryRank) {
  const Plan plan = lower(make_schedule("1f1b", 3, 6));
  auto tr = local_transports(3);
  auto tasks = make_tasks(plan);
  tasks[1]->fail_at = 2;
  ExecutorOptions eo;
  eo.timeout = 20s;
  const auto t0 = Clock::now();
  auto errors = run_ranks(build_rank_ir(plan), tr, tasks, 1, eo);
  EXPECT_LT(Clock::now() - t0, 10s);  // the failure, not the 20 s timeout
  EXPECT_NE(errors[1].find("injected failure"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("rank 1 #"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("RUN"), std::string::npos) << errors[1];
  for (int r : {0, 2}) {
    EXPECT_NE(errors[static_cast<size_t>(r)].find("rank 1 failed"), std::string::npos)
        << errors[static_cast<size_t>(r)];
    EXPECT_NE(errors[static_cast<size_t>(r)].find(fmt::format("rank {} #", r)), std::string::npos)
        << errors[static_cast<size_t>(r)];
  }
}

TEST(RuntimeGloo, TaskFailureStopsEveryRank) {
  const Plan plan = lower(make_schedule("zbh1", 3, 6));
  auto tr = gloo_transports(3);
  auto tasks = make_tasks(plan);
  tasks[2]->fail_at = 3;
  ExecutorOptions eo;
  eo.timeout = 20s;
  const auto t0 = Clock::now();
  auto errors = run_ranks(build_rank_ir(plan), tr, tasks, 1, eo);
  EXPECT_LT(Clock::now() - t0, 10s);  // the failure, not the 20 s timeout
  EXPECT_NE(errors[2].find("injected failure"), std::string::npos) << errors[2];
  for (int r : {0, 1})
    EXPECT_NE(errors[static_cast<size_t>(r)].find("rank 2 failed"), std::string::npos)
        << errors[static_cast<size_t>(r)];
}

TEST(RuntimeGloo, TimeoutNamesPeerAndBuffer) {
  const Plan plan = lower(make_schedule("1f1b", 2, 2));
  auto tr = gloo_transports(2);
  FakeTasks tasks(plan);
  ExecutorOptions eo;
  eo.timeout = 300ms;
  const RankIR ir = build_rank_ir(plan);
  Executor ex(ir, 0, *tr[0], tasks, eo);  // rank 1 never runs
  const auto t0 = Clock::now();
  try {
    ex.run();
    FAIL() << "expected a timeout";
  } catch (const ExecutionError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("timed out"), std::string::npos) << m;
    EXPECT_NE(m.find("grad(s1,m0) from rank 1"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0 #"), std::string::npos) << m;
  }
  // After the 0.3 s timeout and well before a hang; 10 s for a loaded machine.
  EXPECT_GE(Clock::now() - t0, 300ms);
  EXPECT_LT(Clock::now() - t0, 10s);
  // Rank 1 was told: its next run stops at once, naming rank 0.
  FakeTasks t1(plan);
  Executor ex1(ir, 1, *tr[1], t1, eo);
  const auto deadline = Clock::now() + 10s;
  while (!tr[1]->failure() && Clock::now() < deadline) std::this_thread::sleep_for(5ms);
  ASSERT_TRUE(tr[1]->failure().has_value());
  EXPECT_EQ(tr[1]->failure()->first, 0);
  EXPECT_THROW(ex1.run(), ExecutionError);
}

TEST(RuntimeLocal, HandshakeReportsDifference) {
  const Plan a = lower(make_schedule("1f1b", 2, 4));
  const Plan b = lower(make_schedule("1f1b", 2, 6));
  auto tr = local_transports(2);
  FakeTasks ta(a), tb(b);
  const RankIR ia = build_rank_ir(a), ib = build_rank_ir(b);
  std::string e0, e1;
  std::thread t([&] {
    try {
      Executor(ib, 1, *tr[1], tb).handshake(5s);
    } catch (const ExecutionError& e) {
      e1 = e.what();
    }
  });
  try {
    Executor(ia, 0, *tr[0], ta).handshake(5s);
  } catch (const ExecutionError& e) {
    e0 = e.what();
  }
  t.join();
  EXPECT_NE(e0.find("rank 1 has"), std::string::npos) << e0;
  EXPECT_NE(e0.find("microbatches=6"), std::string::npos) << e0;
  EXPECT_NE(e0.find("plan="), std::string::npos) << e0;
  EXPECT_NE(e1.find("rank 0 has"), std::string::npos) << e1;
}

TEST(RuntimeGloo, HandshakeAgreesAndTimesOut) {
  const Plan a = lower(make_schedule("1f1b", 2, 4));
  auto tr = gloo_transports(2);
  FakeTasks ta(a);
  const RankIR ia = build_rank_ir(a);
  try {
    Executor(ia, 0, *tr[0], ta).handshake(200ms);  // rank 1 never answers
    FAIL();
  } catch (const ExecutionError& e) {
    EXPECT_NE(std::string(e.what()).find("no answer from rank 1"), std::string::npos) << e.what();
  }
}

TEST(Runtime, ExecutorRejectsMismatchedTransport) {
  const Plan a = lower(make_schedule("1f1b", 2, 4));
  auto tr = local_transports(3);
  FakeTasks ta(a);
  const RankIR ia = build_rank_ir(a);
  EXPECT_THROW(Executor(ia, 0, *tr[0], ta), ConfigError);
  EXPECT_THROW(Executor(ia, 5, *tr[0], ta), ConfigError);
}

// The executor runs the rank program: two ranks over the in-process
// transport, every instruction once, and its events are the plan's
// instructions (one per plan instruction, in plan order).
TEST(RuntimeLocal, RunsTheRankProgram) {
  const Plan plan = lower(make_schedule("1f1b", 2, 4));
  const RankIR ir = build_rank_ir(plan);
  auto tr = local_transports(2);
  auto tasks = make_tasks(plan);
  ExecutorOptions eo;
  eo.record_events = true;
  std::vector<std::vector<Event>> ev;
  check_results(plan, tasks, 1, run_ranks(ir, tr, tasks, 1, eo, &ev));
  for (int r = 0; r < 2; ++r) {
    const auto& prog = plan.programs[static_cast<size_t>(r)];
    const auto& e = ev[static_cast<size_t>(r)];
    ASSERT_EQ(e.size(), prog.size()) << "rank " << r;
    for (size_t i = 0; i < e.size(); ++i) {
      EXPECT_EQ(e[i].instr, static_cast<int32_t>(i));
      EXPECT_EQ(e[i].op, prog[i].op);
      EXPECT_EQ(e[i].buffer, prog[i].buffer);
      EXPECT_LE(e[i].posted, e[i].completed) << plan.describe(r, static_cast<int>(i));
    }
  }
}

// A WAIT whose send never comes times out, naming the rank, the WAIT and the
// buffer; an offloading program is refused by name.
TEST(RuntimeLocal, WaitThatNeverArrivesTimesOut) {
  const Plan plan = lower(make_schedule("gpipe", 2, 2));
  const RankIR ir = build_rank_ir(plan);
  auto tr = local_transports(2);
  FakeTasks tasks(plan);
  ExecutorOptions eo;
  eo.timeout = 200ms;
  Executor ex(ir, 1, *tr[1], tasks, eo);  // rank 0 never runs
  try {
    ex.run();
    FAIL() << "expected a timeout";
  } catch (const ExecutionError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 1 #"), std::string::npos) << m;
    EXPECT_NE(m.find("WAIT act(s0,m0)<-0"), std::string::npos) << m;
    EXPECT_NE(m.find("timed out after 0.2 s waiting to receive act(s0,m0) from rank 0"),
              std::string::npos)
        << m;
  }
  RankIROptions off;
  off.offload = {Offload::Stash, Offload::None};
  const RankIR oir = build_rank_ir(lower(make_schedule("1f1b", 2, 4)), off);
  auto tr2 = local_transports(2);
  FakeTasks t0(oir.plan);
  try {
    Executor bad(oir, 0, *tr2[0], t0);
    FAIL() << "an offloading program was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("does not offload"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("OFFLOAD"), std::string::npos) << e.what();
  }
}

// Without CUDA support compiled in, or without a GPU, asking for NCCL is a
// clear baton::Error, never a crash.
TEST(Runtime, NcclWithoutGpuIsACleanError) {
  try {
    auto t = make_nccl_transport(0, 1, 0, make_hash_store());
    EXPECT_EQ(t->kind(), "nccl");  // only on a machine with a GPU
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(m.find("NCCL") != std::string::npos || m.find("CUDA") != std::string::npos) << m;
  }
  EXPECT_THROW(make_nccl_transport(3, 2, 0, make_hash_store()), ConfigError);
}

}  // namespace
}  // namespace baton::runtime
