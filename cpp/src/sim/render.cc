// Pictures and traces of a simulated run: Chrome/Perfetto trace JSON, SVG
// timeline, terminal text grid and the summary table.
#include "baton/render.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

#include "baton/verify.h"

namespace baton {

namespace {

using nlohmann::json;

const char* kind_category(const Action& a) {
  if (a.is_fused()) return "fused";
  switch (a.first.kind) {
    case TaskKind::F:
      return "F";
    case TaskKind::B:
      return "B";
    case TaskKind::I:
      return "I";
    case TaskKind::W:
      return "W";
  }
  return "?";
}

const Action& action_of(const Plan& plan, const RunEvent& e) {
  return plan.schedule.rank_actions.at(e.rank).at(e.action);
}

// Buffer name from the dense id ("act(s0,m1)"; "buf7" when out of range).
std::string buffer_name(const Plan& plan, int32_t id) {
  if (id < 0 || id >= plan.num_buffer_ids()) return fmt::format("buf{}", id);
  return plan.describe_buffer(id);
}

std::string xml_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string fmt_time(double t) { return fmt::format("{:.6g}", t); }

std::string fmt_bytes(int64_t b) {
  if (b < 1024) return fmt::format("{} B", b);
  static const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(b);
  int u = -1;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return fmt::format("{:.2f} {}", v, kUnits[u]);
}

// A "nice" tick spacing (1, 2 or 5 times a power of ten) for about n ticks.
double nice_step(double span, int n) {
  if (!(span > 0)) return 1.0;
  const double raw = span / n;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * p) return m * p;
  return 10.0 * p;
}

}  // namespace

std::string to_chrome_trace(const Plan& plan, const SimResult& r, double time_unit_us) {
  const int P = plan.schedule.num_ranks;
  auto us = [&](double t) { return t * time_unit_us; };
  json events = json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", 0},
                    {"args", {{"name", fmt::format("baton {}", plan.schedule.name)}}}});
  for (int rank = 0; rank < P; ++rank) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", rank},
                      {"args", {{"name", fmt::format("rank {}", rank)}}}});
    events.push_back({{"name", "thread_sort_index"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", rank},
                      {"args", {{"sort_index", rank}}}});
  }
  for (const RunEvent& e : r.runs) {
    const Action& a = action_of(plan, e);
    json args = {{"stage", a.first.stage},
                 {"microbatch", a.first.microbatch},
                 {"instr", e.instr},
                 {"action", e.action}};
    if (a.is_fused()) {
      args["second_stage"] = a.second.stage;
      args["second_microbatch"] = a.second.microbatch;
    }
    events.push_back({{"name", to_string(a)},
                      {"cat", kind_category(a)},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", e.rank},
                      {"ts", us(e.start)},
                      {"dur", us(e.end - e.start)},
                      {"args", std::move(args)}});
  }
  // One track per used link, numbered in (src, dst) order after the ranks.
  std::map<std::pair<int, int>, int> link_tid;
  for (const TransferEvent& t : r.transfers) link_tid.emplace(std::make_pair(t.src, t.dst), 0);
  int next_tid = P;
  for (auto& [link, tid] : link_tid) {
    tid = next_tid++;
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", tid},
                      {"args", {{"name", fmt::format("link {}->{}", link.first, link.second)}}}});
    events.push_back({{"name", "thread_sort_index"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", tid},
                      {"args", {{"sort_index", tid}}}});
  }
  for (size_t k = 0; k < r.transfers.size(); ++k) {
    const TransferEvent& t = r.transfers[k];
    const int tid = link_tid[{t.src, t.dst}];
    const std::string name = buffer_name(plan, t.buffer);
    events.push_back({{"name", name},
                      {"cat", "transfer"},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", tid},
                      {"ts", us(t.start)},
                      {"dur", us(t.end - t.start)},
                      {"args",
                       {{"src", t.src},
                        {"dst", t.dst},
                        {"bytes", t.bytes},
                        {"posted", us(t.posted)},
                        {"send_instr", t.send_instr},
                        {"recv_instr", t.recv_instr}}}});
    events.push_back({{"name", name},
                      {"cat", "transfer"},
                      {"ph", "s"},
                      {"id", k},
                      {"pid", 0},
                      {"tid", tid},
                      {"ts", us(t.start)}});
    events.push_back({{"name", name},
                      {"cat", "transfer"},
                      {"ph", "f"},
                      {"id", k},
                      {"pid", 0},
                      {"tid", t.dst},
                      {"ts", us(t.end)}});
  }
  for (size_t rank = 0; rank < r.memory.size(); ++rank) {
    const std::string name = fmt::format("memory rank {}", rank);
    for (const MemorySample& m : r.memory[rank])
      events.push_back({{"name", name},
                        {"ph", "C"},
                        {"pid", 0},
                        {"tid", static_cast<int>(rank)},
                        {"ts", us(m.time)},
                        {"args", {{"activation", m.activation}, {"total", m.total}}}});
  }
  json root = {{"traceEvents", std::move(events)},
               {"displayTimeUnit", "ms"},
               {"otherData",
                {{"schedule", plan.schedule.name},
                 {"ranks", P},
                 {"stages", plan.schedule.num_stages},
                 {"microbatches", plan.schedule.num_microbatches},
                 {"step_time", r.step_time},
                 {"bubble_fraction", r.bubble_fraction}}}};
  return root.dump();
}

std::string to_svg(const Plan& plan, const SimResult& r) {
  const int P = plan.schedule.num_ranks;
  const double left = 72, right = 24, top = 34, row_h = 26, row_gap = 6;
  const double plot_w = 1100;
  const double rows_h = P * (row_h + row_gap);
  const double axis_y = top + rows_h + 4;
  const double legend_y = axis_y + 34;
  const double width = left + plot_w + right, height = legend_y + 30;
  const double step = r.step_time > 0 ? r.step_time : 1.0;
  auto X = [&](double t) { return left + t / step * plot_w; };
  auto row_y = [&](int rank) { return top + rank * (row_h + row_gap); };
  static const std::pair<const char*, const char*> kColours[] = {
      {"F", "#4e79a7"}, {"B", "#f28e2b"}, {"I", "#e15759"}, {"W", "#59a14f"}, {"fused", "#b07aa1"}};
  auto colour = [&](const char* cat) {
    for (const auto& [k, c] : kColours)
      if (std::string_view(k) == cat) return c;
    return "#999999";
  };
  std::vector<bool> multi(P, false);
  for (int rank = 0; rank < P; ++rank) multi[rank] = plan.schedule.stages_of_rank(rank).size() > 1;

  std::string out;
  out.reserve(256 + r.runs.size() * 200);
  out += fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" "
      "viewBox=\"0 0 {:.0f} {:.0f}\" font-family=\"sans-serif\" font-size=\"11\">\n",
      width, height, width, height);
  out +=
      fmt::format("<rect class=\"background\" width=\"100%\" height=\"100%\" fill=\"white\"/>\n");
  out += fmt::format(
      "<text class=\"title\" x=\"{:.1f}\" y=\"20\" font-size=\"14\">{}: {} ranks, {} stages, {} "
      "microbatches, step {}, bubble {:.1f}%</text>\n",
      left, xml_escape(plan.schedule.name), P, plan.schedule.num_stages,
      plan.schedule.num_microbatches, fmt_time(r.step_time), 100.0 * r.bubble_fraction);
  for (int rank = 0; rank < P; ++rank) {
    const double y = row_y(rank);
    out += fmt::format(
        "<rect class=\"lane\" x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" "
        "fill=\"#eeeeee\"/>\n",
        left, y, plot_w, row_h);
    out += fmt::format(
        "<text class=\"rank-label\" x=\"{:.1f}\" y=\"{:.2f}\" text-anchor=\"end\">rank {}</text>\n",
        left - 8, y + row_h / 2 + 4, rank);
  }
  for (const RunEvent& e : r.runs) {
    const Action& a = action_of(plan, e);
    const char* cat = kind_category(a);
    const double x0 = X(e.start), x1 = X(e.end), y = row_y(e.rank);
    const double w = std::max(x1 - x0, 0.5);
    out += fmt::format(
        "<rect class=\"action kind-{}\" x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" "
        "height=\"{:.2f}\" fill=\"{}\" stroke=\"white\" stroke-width=\"0.5\"><title>rank {} {} "
        "[{}, {})</title></rect>\n",
        cat, x0, y, w, row_h, colour(cat), e.rank, to_string(a), fmt_time(e.start),
        fmt_time(e.end));
    const std::string label = multi[e.rank]
                                  ? fmt::format("{}/{}", a.first.microbatch, a.first.stage)
                                  : fmt::format("{}", a.first.microbatch);
    if (w >= 6.5 * label.size() + 3)
      out += fmt::format(
          "<text class=\"action-label\" x=\"{:.2f}\" y=\"{:.2f}\" text-anchor=\"middle\" "
          "fill=\"white\">{}</text>\n",
          x0 + w / 2, y + row_h / 2 + 4, label);
  }
  // Time axis.
  out += fmt::format(
      "<line class=\"axis\" x1=\"{:.2f}\" y1=\"{:.2f}\" x2=\"{:.2f}\" y2=\"{:.2f}\" "
      "stroke=\"black\"/>\n",
      left, axis_y, left + plot_w, axis_y);
  const double tick = nice_step(step, 10);
  for (int k = 0; k * tick <= step * (1 + 1e-9) && k < 1000; ++k) {
    const double t = k * tick, x = X(t);
    out += fmt::format(
        "<line class=\"tick\" x1=\"{:.2f}\" y1=\"{:.2f}\" x2=\"{:.2f}\" y2=\"{:.2f}\" "
        "stroke=\"black\"/>\n<text class=\"tick-label\" x=\"{:.2f}\" y=\"{:.2f}\" "
        "text-anchor=\"middle\">{}</text>\n",
        x, axis_y, x, axis_y + 5, x, axis_y + 18, fmt_time(t));
  }
  // Legend.
  double lx = left;
  for (const auto& [k, c] : kColours) {
    out += fmt::format(
        "<rect class=\"legend\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"14\" height=\"14\" "
        "fill=\"{}\"/>\n<text class=\"legend-label\" x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n",
        lx, legend_y, c, lx + 18, legend_y + 11, k);
    lx += 80;
  }
  out += fmt::format(
      "<rect class=\"legend\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"14\" height=\"14\" "
      "fill=\"#eeeeee\"/>\n<text class=\"legend-label\" x=\"{:.1f}\" y=\"{:.1f}\">idle</text>\n",
      lx, legend_y, lx + 18, legend_y + 11);
  out += "</svg>\n";
  return out;
}

std::string to_text_grid(const Plan& plan, const SimResult& r, int width) {
  const int P = plan.schedule.num_ranks;
  const double step = r.step_time;
  int cols = width;
  if (cols <= 0) {
    double dmin = 0;
    for (const RunEvent& e : r.runs) {
      const double d = e.end - e.start;
      if (d > 0 && (dmin == 0 || d < dmin)) dmin = d;
    }
    cols = dmin > 0 ? static_cast<int>(std::ceil(step / dmin - 1e-9)) : 1;
    cols = std::clamp(cols, 1, 200);
  }
  const double dt = step > 0 ? step / cols : 0.0;
  const int digits =
      static_cast<int>(fmt::format("{}", std::max(plan.schedule.num_microbatches - 1, 0)).size());
  const int cell = 1 + digits;  // letter + microbatch, then one space between cells

  // Runs are sorted by (rank, start): find each rank's slice.
  std::vector<size_t> begin(P + 1, r.runs.size());
  for (int rank = 0; rank < P; ++rank)
    begin[rank] =
        static_cast<size_t>(std::partition_point(r.runs.begin(), r.runs.end(),
                                                 [&](const RunEvent& e) { return e.rank < rank; }) -
                            r.runs.begin());
  std::string out = fmt::format("{}: {} ranks, step {}, {} columns of {}\n", plan.schedule.name, P,
                                fmt_time(step), cols, fmt_time(dt));
  const int label_w = static_cast<int>(fmt::format("{}", std::max(P - 1, 0)).size());
  for (int rank = 0; rank < P; ++rank) {
    out += fmt::format("rank {:>{}} |", rank, label_w);
    size_t k = begin[rank];
    const size_t end = begin[rank + 1];
    for (int c = 0; c < cols; ++c) {
      const double mid = (c + 0.5) * dt;
      while (k < end && r.runs[k].end <= mid) ++k;
      std::string txt = ".";
      if (k < end && r.runs[k].start <= mid && mid < r.runs[k].end) {
        const Action& a = action_of(plan, r.runs[k]);
        const char letter = a.is_fused() ? 'X' : task_kind_char(a.first.kind);
        txt = fmt::format("{}{}", letter, a.first.microbatch);
      }
      out += fmt::format(" {:<{}}", txt, cell);
    }
    out += "\n";
  }
  return out;
}

std::string summary_table(const Plan& plan, const SimResult& r, const VerifyReport* report) {
  const Schedule& s = plan.schedule;
  std::string out;
  out += fmt::format("{:<14}{}\n", "schedule", s.name);
  out += fmt::format("{:<14}{}\n", "ranks", s.num_ranks);
  out += fmt::format("{:<14}{}\n", "stages", s.num_stages);
  out += fmt::format("{:<14}{}\n", "microbatches", s.num_microbatches);
  out += fmt::format("{:<14}{}\n", "step time", fmt_time(r.step_time));
  out += fmt::format("{:<14}{:.2f}%\n", "bubble", 100.0 * r.bubble_fraction);
  // Rank programs that offload hold bytes in host memory too: one more column.
  const bool host = std::any_of(r.peak_host_bytes.begin(), r.peak_host_bytes.end(),
                                [](int64_t b) { return b > 0; });
  out += fmt::format("{:>5}  {:>12}  {:>8}  {:>12}  {:>12}  {:>12}  {:>12}{}\n", "rank", "busy",
                     "bubble", "first start", "last end", "peak act", "peak total",
                     host ? fmt::format("  {:>12}", "peak host") : "");
  for (int rank = 0; rank < s.num_ranks; ++rank) {
    auto at = [&](const auto& v, auto dflt) {
      return static_cast<size_t>(rank) < v.size() ? v[rank] : dflt;
    };
    out += fmt::format("{:>5}  {:>12}  {:>7.2f}%  {:>12}  {:>12}  {:>12}  {:>12}{}\n", rank,
                       fmt_time(at(r.busy, 0.0)), 100.0 * at(r.bubble, 0.0),
                       fmt_time(at(r.span_start, 0.0)), fmt_time(at(r.span_end, 0.0)),
                       fmt_bytes(at(r.peak_activation, int64_t{0})),
                       fmt_bytes(at(r.peak_total, int64_t{0})),
                       host ? fmt::format("  {:>12}", fmt_bytes(at(r.peak_host_bytes, int64_t{0})))
                            : "");
  }
  if (report == nullptr) {
    out += "verification: not run\n";
  } else if (report->ok()) {
    out += "verification: OK\n";
  } else {
    out += fmt::format("verification: FAILED ({} violation{})\n", report->violations.size(),
                       report->violations.size() == 1 ? "" : "s");
    for (const Violation& v : report->violations)
      out += fmt::format("  {}: {}\n", v.check, v.message);
  }
  return out;
}

}  // namespace baton
