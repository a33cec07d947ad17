// The transfer benchmark (bench/ffi_transfer.py): round trips between two
// transports of this process, through RankComm and straight on the transports.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <thread>
#include <utility>

#include "baton/error.h"
#include "baton/transfer_bench.h"

namespace baton::runtime {
namespace {

using Transports = std::pair<std::shared_ptr<Transport>, std::shared_ptr<Transport>>;

Transports local_pair() {
  auto hub = LocalHub::create(2);
  return {std::shared_ptr<Transport>(hub->transport(0)),
          std::shared_ptr<Transport>(hub->transport(1))};
}

Transports gloo_pair() {
  auto store = make_hash_store();
  GlooOptions o;
  o.connect_timeout = std::chrono::milliseconds(20000);
  std::shared_ptr<Transport> t0, t1;
  std::thread th([&] { t1 = make_gloo_transport(1, 2, store, o); });
  t0 = make_gloo_transport(0, 2, store, o);
  th.join();
  return {t0, t1};
}

void expect_round_trips(const Transports& t, bool through_comm) {
  const double s = pingpong_seconds(t.first, t.second, 4096, 8, through_comm);
  EXPECT_TRUE(std::isfinite(s));
  EXPECT_GT(s, 0.0);
  EXPECT_LT(s, 60.0);
}

TEST(RuntimeTransferBench, LocalRoundTripsStraightOnTheTransports) {
  expect_round_trips(local_pair(), false);
}

TEST(RuntimeTransferBench, LocalRoundTripsThroughRankComm) {
  expect_round_trips(local_pair(), true);
}

TEST(RuntimeTransferBench, GlooRoundTripsBothWays) {
  // One pair of transports serves both measurements, as in the benchmark.
  const Transports t = gloo_pair();
  expect_round_trips(t, false);
  expect_round_trips(t, true);
}

TEST(RuntimeTransferBench, AClosedTransportIsAConfigError) {
  const Transports t = local_pair();
  EXPECT_THROW(pingpong_seconds(t.first, nullptr, 16, 1, false), ConfigError);
  EXPECT_THROW(pingpong_seconds(nullptr, t.second, 16, 1, true), ConfigError);
}

}  // namespace
}  // namespace baton::runtime
