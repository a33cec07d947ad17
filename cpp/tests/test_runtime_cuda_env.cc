// The CUDA environment checks (cuda_env.h) and the abort guard's lock order
// (staging::AbortOnce::first_under): host side, on any machine.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <atomic>
#include <functional>
#include <future>
#include <stdexcept>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "baton/cuda_env.h"
#include "baton/nccl_comm.h"

namespace baton::runtime {
namespace {

bool has(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

TEST(CudaEnv, OneDeviceConnectionIsRefusedByName) {
  EXPECT_EQ(cuda_env::max_connections_problem(nullptr), "");
  EXPECT_EQ(cuda_env::max_connections_problem(""), "");
  EXPECT_EQ(cuda_env::max_connections_problem("8"), "");
  EXPECT_EQ(cuda_env::max_connections_problem("2"), "");
  EXPECT_EQ(cuda_env::max_connections_problem("1x"), "");  // not a number: CUDA's default
  const std::string m = cuda_env::max_connections_problem("1");
  EXPECT_TRUE(has(m, "CUDA_DEVICE_MAX_CONNECTIONS=1")) << m;
  EXPECT_TRUE(has(m, "2 or more")) << m;
}

TEST(CudaEnv, AnOldDriverIsNamedAsSuch) {
  EXPECT_EQ(cuda_env::driver_problem(13000, 13000), "");
  EXPECT_EQ(cuda_env::driver_problem(13020, 13000), "");  // newer driver
  EXPECT_EQ(cuda_env::driver_problem(13000, 13020), "");  // minor version compatibility
  const std::string m = cuda_env::driver_problem(12080, 13000);
  EXPECT_TRUE(has(m, "the NVIDIA driver is too old: it supports CUDA 12.8")) << m;
  EXPECT_TRUE(has(m, "Baton's CUDA runtime is 13.0")) << m;
  const std::string none = cuda_env::driver_problem(0, 13000);
  EXPECT_TRUE(has(none, "no NVIDIA driver is installed")) << none;
  EXPECT_EQ(cuda_env::cuda_version_string(12080), "12.8");
}

TEST(CudaEnv, ASecondNcclCopyIsNamed) {
  EXPECT_EQ(cuda_env::second_nccl_problem({}, ""), "");
  EXPECT_EQ(cuda_env::second_nccl_problem({"/a/libnccl.so.2"}, "/a/libnccl.so.2"), "");
  const std::string m = cuda_env::second_nccl_problem(
      {"/usr/lib/libnccl.so.2", "/site-packages/nvidia/nccl/lib/libnccl.so.2"},
      "/usr/lib/libnccl.so.2");
  EXPECT_TRUE(has(m, "2 copies of libnccl")) << m;
  EXPECT_TRUE(has(m, "/site-packages/nvidia/nccl/lib/libnccl.so.2")) << m;
  EXPECT_TRUE(has(m, "Baton uses /usr/lib/libnccl.so.2")) << m;
}

// The abort marks the communicators gone under the lock, after the call in
// flight, and then runs without it: a thread that needs the lock meanwhile (the
// XLA thread's next NCCL call) gets it at once and sees them gone.
TEST(CudaEnv, AbortRunsWithoutTheLockTheXlaThreadNeeds) {
  std::mutex mu;
  staging::AbortOnce gone;
  std::unique_lock<std::mutex> in_flight(mu);  // an NCCL call in flight
  auto aborter = std::async(std::launch::async, [&] {
    const bool first = gone.first_under(mu);
    // "ncclCommAbort" here: the XLA thread takes the lock meanwhile.
    auto xla = std::async(std::launch::async, [&] {
      std::lock_guard<std::mutex> lock(mu);
      return gone.done();
    });
    const bool xla_ran = xla.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
    return first && xla_ran && xla.get();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(gone.done());  // waits for the call in flight
  in_flight.unlock();
  ASSERT_EQ(aborter.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_TRUE(aborter.get());
  EXPECT_FALSE(gone.first_under(mu));  // once only
}

}  // namespace
}  // namespace baton::runtime

namespace baton::runtime {
namespace {

// NcclComm refuses CUDA_DEVICE_MAX_CONNECTIONS=1 by name before it looks for a device.
TEST(CudaEnv, NcclCommRefusesOneConnection) {
  if (!NcclComm::built()) GTEST_SKIP() << "built without CUDA";
  const char* was = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const std::string saved = was ? was : "";
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 1);
  std::string msg;
  try {
    NcclComm c(0, 1, 0, make_hash_store(), {}, std::chrono::milliseconds(1000));
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  if (was)
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", saved.c_str(), 1);
  else
    unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
  EXPECT_TRUE(has(msg, "NcclRankComm: CUDA_DEVICE_MAX_CONNECTIONS=1 is set")) << msg;
}

}  // namespace
}  // namespace baton::runtime

namespace baton::runtime {
namespace {

// The contexts are closed at once: every job runs while the others do (each
// waits until all have started, which one thread after another never reaches).
TEST(CudaEnv, ContextsCloseConcurrentlyNotOneAfterAnother) {
  constexpr int kJobs = 4;
  std::atomic<int> started{0};
  std::atomic<int> finished{0};
  std::vector<std::function<void()>> jobs;
  for (int i = 0; i < kJobs; ++i)
    jobs.push_back([&, i] {
      ++started;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (started.load() < kJobs && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (started.load() == kJobs) ++finished;
      if (i == 0) throw std::runtime_error("a close that fails does not stop the others");
    });
  staging::run_concurrently(jobs);
  EXPECT_EQ(finished.load(), kJobs);
}

TEST(CudaEnv, CloseAllWithNoContexts) {
  register_nccl_comm(nullptr);  // not a context: nothing to close
  EXPECT_EQ(close_all_nccl_comms(), 0u);
}

}  // namespace
}  // namespace baton::runtime
