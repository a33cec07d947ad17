// What the simulator derives once every event is placed: each rank's memory
// timeline merged with the releases that waited for sends, its peaks, and the
// critical path.
#include <algorithm>
#include <charconv>
#include <string>
#include <vector>

#include "sim_internal.h"

namespace baton::sim_detail {

namespace {

void append_int(std::string& out, int v) {
  char buf[16];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, res.ptr);
}

// Same text as to_string(Task): "F3.1".
void append_task(std::string& out, const Task& t) {
  out += task_kind_char(t.kind);
  append_int(out, t.stage);
  out += '.';
  append_int(out, t.microbatch);
}

}  // namespace

// Merges the releases that waited for sends into each rank's timeline and
// takes the peaks. A sample holds the value after every event at its time.
void Simulator::finish_memory() {
  res_.peak_activation.assign(P_, 0);
  res_.peak_total.assign(P_, 0);
  res_.peak_host_bytes.assign(P_, 0);
  std::vector<MemorySample> merged;
  for (int32_t r = 0; r < P_; ++r) {
    auto& late = late_[r];
    auto& samples = res_.memory[r];
    if (!late.empty()) {
      std::sort(late.begin(), late.end(),
                [](const MemEvent& a, const MemEvent& b) { return a.time < b.time; });
      merged.clear();
      merged.reserve(samples.size() + late.size());
      size_t i = 0, j = 0;
      MemorySample cur{0, 0, 0};
      int64_t late_act = 0, late_total = 0;
      while (i < samples.size() || j < late.size()) {
        double t = kInf;
        if (i < samples.size()) t = samples[i].time;
        if (j < late.size()) t = std::min(t, late[j].time);
        if (i < samples.size() && samples[i].time == t) cur = samples[i++];
        for (; j < late.size() && late[j].time == t; ++j) {
          late_act += late[j].act;
          late_total += late[j].total;
        }
        merged.push_back({t, cur.activation + late_act, cur.total + late_total});
      }
      samples.swap(merged);
    }
    if (samples.empty() || samples.front().time > 0) samples.insert(samples.begin(), {0.0, 0, 0});
    int64_t pa = 0, pt = 0;
    for (const MemorySample& m : samples) {
      pa = std::max(pa, m.activation);
      pt = std::max(pt, m.total);
    }
    res_.peak_activation[r] = pa;
    res_.peak_total[r] = pt;
  }
}

void Simulator::build_critical_path() {
  // Find the event that ends last (RUNs preferred on ties).
  Pred node = Pred::None;
  int32_t idx = -1;
  double best = -kInf;
  for (size_t k = 0; k < res_.runs.size(); ++k)
    if (res_.runs[k].end > best) {
      best = res_.runs[k].end;
      node = Pred::Run;
      idx = static_cast<int32_t>(k);
    }
  for (size_t k = 0; k < res_.transfers.size(); ++k)
    if (res_.transfers[k].end > best) {
      best = res_.transfers[k].end;
      node = Pred::Transfer;
      idx = static_cast<int32_t>(k);
    }
  std::vector<CriticalStep> path;
  while (node != Pred::None && idx >= 0) {
    if (node == Pred::Run) {
      const RunEvent& r = res_.runs[idx];
      const Action& a = plan_.schedule.rank_actions[r.rank][r.action];
      std::string what = "RUN ";
      append_task(what, a.first);
      if (a.is_fused()) {
        what += '+';
        append_task(what, a.second);
      }
      path.push_back({r.rank, r.instr, r.start, r.end, std::move(what)});
      node = run_pred_[idx].kind;
      idx = run_pred_[idx].index;
    } else {
      const TransferEvent& e = res_.transfers[idx];
      const XferState& x = xs_[idx];
      // "transfer act(s0,m1) 0->1", without fmt: paths can be long.
      std::string what = "transfer ";
      what += plan_.describe_buffer(e.buffer);
      what += ' ';
      append_int(what, e.src);
      what += "->";
      append_int(what, e.dst);
      path.push_back({e.src, e.send_instr, e.start, e.end, std::move(what)});
      switch (x.end_pred) {
        case XferPred::SendPost:
          node = x.send_run >= 0 ? Pred::Run : Pred::None;
          idx = x.send_run;
          break;
        case XferPred::LinkBusy:
          node = Pred::Transfer;
          idx = x.link_prev;
          break;
        case XferPred::RecvPost:
          node = x.recv_run >= 0 ? Pred::Run : Pred::None;
          idx = x.recv_run;
          break;
      }
    }
  }
  std::reverse(path.begin(), path.end());
  res_.critical_path = std::move(path);
}

}  // namespace baton::sim_detail
