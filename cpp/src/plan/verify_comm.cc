// Verifier, comm checks: every SEND paired with a RECV of the same buffer, and
// the pairing of the fifo model (k-th message of a channel with its k-th
// receive), which reports head-of-line mismatches.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "verify_internal.h"

namespace baton::verify_detail {

namespace {

const char* ordinal_suffix(int n) {
  if (n % 100 >= 11 && n % 100 <= 13) return "th";
  switch (n % 10) {
    case 1:
      return "st";
    case 2:
      return "nd";
    case 3:
      return "rd";
    default:
      return "th";
  }
}

}  // namespace

std::string ordinal(int n) { return fmt::format("{}{}", n, ordinal_suffix(n)); }

void Verifier::match_by_buffer(bool report) {
  const int32_t n = n_ops_;
  const OpInfo* ops = opi_.data();
  // Channel positions for the fifo model: the k-th SEND a->b of a buffer
  // kind, the k-th RECV b<-a of that kind.
  chan_k_.resize(n);
  {
    std::vector<int32_t> send_cnt(num_channels(), 0), recv_cnt(send_cnt.size(), 0);
    for (int32_t o = 0; o < n; ++o) {
      const OpInfo& c = ops[o];
      chan_k_[o] = c.send ? send_cnt[channel(c.rank, c.peer, c.buffer)]++
                          : recv_cnt[channel(c.peer, c.rank, c.buffer)]++;
    }
  }
  // bufs_[b].first_send heads the chain of SENDs of b in program order,
  // linked through next.
  BufState* bs = bufs_.data();
  std::vector<int32_t> next(n, -1);
  for (int32_t o = n - 1; o >= 0; --o) {
    const OpInfo& c = ops[o];
    if (!c.send) continue;
    BufState& h = bs[c.buffer];
    next[o] = h.first_send;
    h.first_send = o;
    h.have = c.rank;     // head's rank
    h.freed = c.peer;    // head's peer
    h.acc = chan_k_[o];  // head's channel position
  }
  partner_buf_.assign(n, -1);
  int32_t matched = 0;
  positions_agree_ = true;
  for (int32_t o = 0; o < n; ++o) {
    const OpInfo& rv = ops[o];
    if (rv.send) continue;
    const BufState& h = bs[rv.buffer];
    int32_t q = h.first_send;
    if (q >= 0 && partner_buf_[q] < 0 && h.have == rv.peer && h.freed == rv.rank) {
      positions_agree_ &= h.acc == chan_k_[o];
    } else {
      for (q = q >= 0 ? next[q] : -1; q >= 0; q = next[q])
        if (partner_buf_[q] < 0 && ops[q].rank == rv.peer && ops[q].peer == rv.rank) break;
      if (q < 0) continue;
      positions_agree_ &= chan_k_[q] == chan_k_[o];
    }
    partner_buf_[q] = o;
    partner_buf_[o] = q;
    matched += 2;
  }
  positions_agree_ &= matched == n;
  if (!report) return;
  for (int32_t o = 0; o < n && !full(); ++o) {
    if (partner_buf_[o] >= 0) continue;
    const CommOp c = op(o);
    const BufferKey k = key(c.buffer);
    add("comm",
        fmt::format("comm: {} has no matching {} on rank {}", d(c.rank, c.instr),
                    c.send ? "RECV" : "SEND", c.peer),
        {c.rank}, {c.instr}, k.stage, k.microbatch);
  }
}

bool Verifier::fifo_pairing(bool report) {
  const int32_t n = n_ops_;
  // Every op matched by buffer at its channel position: same pairing.
  fifo_same_ = positions_agree_;
  if (fifo_same_) {
    partner_fifo_.clear();   // empty: same as partner_buf_
    mismatch_fifo_.clear();  // empty: no mismatch
    return true;
  }
  std::vector<std::vector<int32_t>> sends(num_channels()), recvs(sends.size());
  // Slow path: pair the k-th SEND a->b with the k-th RECV b<-a of each kind.
  for (int32_t o = 0; o < n; ++o) {
    const CommOp c = op(o);
    if (c.send)
      sends[channel(c.rank, c.peer, c.buffer)].push_back(o);
    else
      recvs[channel(c.peer, c.rank, c.buffer)].push_back(o);
  }
  partner_fifo_.assign(n, -1);
  mismatch_fifo_.assign(n, 0);
  for (size_t c = 0; c < sends.size(); ++c) {
    const size_t paired = std::min(sends[c].size(), recvs[c].size());
    bool reported = false;
    for (size_t k = 0; k < paired; ++k) {
      const int32_t so = sends[c][k], ro = recvs[c][k];
      partner_fifo_[so] = ro;
      partner_fifo_[ro] = so;
      if (op(so).buffer == op(ro).buffer) continue;
      mismatch_fifo_[so] = mismatch_fifo_[ro] = 1;
      if (!report || reported || full()) continue;
      reported = true;  // the first mismatch per channel explains the rest
      const CommOp s = op(so);
      const CommOp r = op(ro);
      const BufferKey bk = key(r.buffer);
      add("comm",
          fmt::format("comm (fifo model): head-of-line mismatch on the {} channel {}->{}: the {} "
                      "message is {}, but {} expects {}",
                      kind_name(s.buffer), s.rank, s.peer, ordinal(static_cast<int>(k) + 1),
                      d(s.rank, s.instr), d(r.rank, r.instr), buf(r.buffer)),
          {s.rank, r.rank}, {s.instr, r.instr}, bk.stage, bk.microbatch);
    }
  }
  // Same pairing after all (e.g. only unmatched ops): same execution.
  if (std::find(mismatch_fifo_.begin(), mismatch_fifo_.end(), 1) == mismatch_fifo_.end())
    mismatch_fifo_.clear();
  fifo_same_ = partner_fifo_ == partner_buf_ && mismatch_fifo_.empty();
  return fifo_same_;
}

}  // namespace baton::verify_detail
