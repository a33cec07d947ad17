// Gloo start-up: MeshContext connects one rank's full mesh of pairs through
// the rendezvous store under one deadline.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gloo/transport/context.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/address.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "gloo_internal.h"

namespace baton::runtime::gloo_detail {

// The full mesh of one rank's Gloo pairs, connected by Baton itself rather
// than by gloo::rendezvous::Context::connectFullMesh, whose waits are not
// bounded by the timeout it is given: a pair on the listening side of a
// connection waits five times the context timeout for its peer, and the pairs
// connect one after the other, so one unreachable peer kept a rank waiting for
// minutes. Here the whole start-up, rendezvous and connect, ends by one
// deadline (GlooOptions::connect_timeout from the start of the call):
//   1. join:    every rank sets <prefix>/mesh/join/<rank> and waits (until the
//               deadline) for every other rank's key; ranks that never come are
//               named together.
//   2. address: only now the pairs are created (each pair's connect wait is
//               fixed when it is created, as five times the context timeout,
//               so that timeout is set to a fifth of what is left), and the
//               rank publishes <prefix>/mesh/addr/<rank>: for each peer in rank
//               order, a 4-byte little-endian length and the tcp::Address bytes
//               of its pair for that peer.
//   3. connect: every pair connects on its own thread (no chain of waits
//               between ranks); a pair that fails or times out names its peer.
// Afterwards the transport context timeout is lifted: Gloo uses it as the
// default wait of every unbound buffer, and transfer waits are bounded by the
// executor instead (see the file comment of gloo.cc).
void MeshContext::connect(Store& store, const std::string& prefix,
                          const std::shared_ptr<gloo::transport::Device>& dev,
                          std::chrono::milliseconds timeout, const std::string& host) {
  using std::chrono::milliseconds;
  const auto deadline = Clock::now() + timeout;
  auto left = [&] {
    // At least 1 ms, so that keys already present are still seen after the
    // deadline and every missing rank is named, not only the first.
    return std::max(milliseconds(1),
                    std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
  };
  const std::string keys = prefix + "/mesh/";
  auto gather = [&](const std::string& what, const std::string& step) {
    std::vector<std::string> got(static_cast<size_t>(size));
    std::vector<int> missing;
    std::string first_error;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      try {
        got[static_cast<size_t>(p)] = store.get(keys + what + std::to_string(p), left());
      } catch (const std::exception& e) {
        missing.push_back(p);
        if (first_error.empty()) first_error = e.what();
      }
    }
    if (!missing.empty())
      throw ExecutionError(
          fmt::format("rank {}: gloo start-up timed out after {} ms: rank(s) {} {} (store keys "
                      "'{}{}<rank>'; did every rank start, with world size {} and the same "
                      "store?); first store error: {}",
                      rank, timeout.count(), fmt::join(missing, ", "), step, keys, what, size,
                      first_error),
          missing.front());
    return got;
  };

  // 1. join
  store.set(keys + "join/" + std::to_string(rank), "1");
  gather("join/", "never joined");

  // 2. address
  auto tctx = dev->createContext(rank, size);
  tctx->setTimeout(std::max(milliseconds(1), (left() + milliseconds(4)) / 5));
  std::vector<std::vector<char>> pairs;
  for (int p = 0; p < size; ++p)
    if (p != rank) pairs.push_back(tctx->createPair(p)->address().bytes());
  const std::string mine = wire::encode_addresses(pairs);
  store.set(keys + "addr/" + std::to_string(rank), mine);
  const auto blobs = gather("addr/", "joined but published no address");
  std::vector<std::vector<char>> peer_addr(static_cast<size_t>(size));
  for (int p = 0; p < size; ++p) {
    if (p != rank)
      peer_addr[static_cast<size_t>(p)] =
          wire::address_for(blobs[static_cast<size_t>(p)], p, rank, size);
  }

  // 3. connect
  std::vector<std::string> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    threads.emplace_back([&, p] {
      const auto i = static_cast<size_t>(p);
      try {
        tctx->getPair(p)->connect(peer_addr[i]);
      } catch (const std::exception& e) {
        errors[i] = e.what();
        if (errors[i].empty()) errors[i] = "unknown error";
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<int> failed;
  std::string details;
  for (int p = 0; p < size; ++p) {
    const auto i = static_cast<size_t>(p);
    if (errors[i].empty()) continue;
    failed.push_back(p);
    details += fmt::format("; rank {} (at {}): {}", p, describe(peer_addr[i]), errors[i]);
  }
  if (!failed.empty())
    throw ExecutionError(
        fmt::format("rank {}: gloo could not connect to rank(s) {} within {} ms (this rank "
                    "advertises host {}; is that address reachable from the other ranks? set "
                    "BATON_HOSTNAME / hostname to an address they can reach){}",
                    rank, fmt::join(failed, ", "), timeout.count(), host, details),
        failed.front());

  tctx->setTimeout(kNoWaitLimit);
  setTimeout(kNoWaitLimit);
  device_ = dev;
  transportContext_ = std::move(tctx);
}
std::string MeshContext::describe(const std::vector<char>& bytes) {
  try {
    const gloo::transport::tcp::Address addr(bytes);
    sockaddr_storage ss{};
    std::memcpy(&ss, &addr.getSockaddr(), sizeof(ss));
    char host[INET6_ADDRSTRLEN] = {};
    if (ss.ss_family == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
      inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
      return fmt::format("{}:{}", host, ntohs(a->sin_port));
    }
    if (ss.ss_family == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
      inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
      return fmt::format("[{}]:{}", host, ntohs(a->sin6_port));
    }
  } catch (const std::exception&) {
    // fall through
  }
  return "an unreadable address";
}

}  // namespace baton::runtime::gloo_detail
