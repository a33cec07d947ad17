// Stash rematerialization: choose the smallest set of forward values to keep
// for the backward task, recomputing cheap ops (elementwise, shape) instead.
// See min_stash() in graph.h for the formulation.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <queue>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "baton/graph.h"

namespace baton {

namespace {

// Primitives whose output is a cheap function of its inputs: elementwise math,
// comparisons, selects, dtype casts and layout/shape changes. No reductions,
// contractions, gathers, random numbers or calls: those are always kept.
const std::unordered_set<std::string>& recomputable_names() {
  static const std::unordered_set<std::string> names = {"abs",         "add",
                                                        "and",         "broadcast_in_dim",
                                                        "cos",         "convert_element_type",
                                                        "copy",        "div",
                                                        "eq",          "erf",
                                                        "exp",         "exp2",
                                                        "expand_dims", "expm1",
                                                        "ge",          "gt",
                                                        "integer_pow", "le",
                                                        "log",         "log1p",
                                                        "logistic",    "lt",
                                                        "max",         "min",
                                                        "mul",         "ne",
                                                        "neg",         "not",
                                                        "or",          "pow",
                                                        "reshape",     "rsqrt",
                                                        "select_n",    "sign",
                                                        "sin",         "sqrt",
                                                        "square",      "squeeze",
                                                        "sub",         "tanh",
                                                        "transpose",   "clamp",
                                                        "erf_inv",     "is_finite"};
  return names;
}

// Dinic max-flow on a small graph; capacities in bytes (kInf = uncuttable).
class MaxFlow {
 public:
  static constexpr int64_t kInf = int64_t{1} << 60;
  explicit MaxFlow(int n) : adj_(static_cast<size_t>(n)), level_(n), it_(n) {}

  void edge(int u, int v, int64_t cap) {
    adj_[u].push_back(static_cast<int>(e_.size()));
    e_.push_back({v, cap});
    adj_[v].push_back(static_cast<int>(e_.size()));
    e_.push_back({u, 0});
  }

  void run(int s, int t) {
    while (bfs(s, t)) {
      std::fill(it_.begin(), it_.end(), 0);
      while (dfs(s, t, kInf) > 0) {
      }
    }
  }

  // Nodes that can still reach t in the residual graph.
  std::vector<bool> reaches(int t) const {
    std::vector<bool> seen(adj_.size(), false);
    std::vector<int> stack{t};
    seen[t] = true;
    while (!stack.empty()) {
      int v = stack.back();
      stack.pop_back();
      for (int id : adj_[v]) {
        // reverse edge id^1 goes u -> v with residual e_[id^1].cap
        int u = e_[id].to;
        if (!seen[u] && e_[id ^ 1].cap > 0) {
          seen[u] = true;
          stack.push_back(u);
        }
      }
    }
    return seen;
  }

 private:
  struct E {
    int to;
    int64_t cap;
  };
  bool bfs(int s, int t) {
    std::fill(level_.begin(), level_.end(), -1);
    std::queue<int> q;
    level_[s] = 0;
    q.push(s);
    while (!q.empty()) {
      int v = q.front();
      q.pop();
      for (int id : adj_[v]) {
        if (e_[id].cap > 0 && level_[e_[id].to] < 0) {
          level_[e_[id].to] = level_[v] + 1;
          q.push(e_[id].to);
        }
      }
    }
    return level_[t] >= 0;
  }
  int64_t dfs(int v, int t, int64_t f) {
    if (v == t) return f;
    for (int& k = it_[v]; k < static_cast<int>(adj_[v].size()); ++k) {
      int id = adj_[v][k];
      E& e = e_[id];
      if (e.cap <= 0 || level_[e.to] != level_[v] + 1) continue;
      int64_t got = dfs(e.to, t, std::min(f, e.cap));
      if (got > 0) {
        e.cap -= got;
        e_[id ^ 1].cap += got;
        return got;
      }
    }
    return 0;
  }
  std::vector<std::vector<int>> adj_;
  std::vector<E> e_;
  std::vector<int> level_, it_;
};

bool is_free(const Program& p, int32_t v) {
  ValueKind k = p.values[v].kind;
  return k == ValueKind::Literal || k == ValueKind::LoopInvariant || k == ValueKind::LoopMicrobatch;
}

}  // namespace

bool is_recomputable(const Op& op) {
  return op.kind == OpKind::Compute && op.outputs.size() == 1 &&
         recomputable_names().count(op.name) > 0;
}

Remat min_stash(const Program& p, const std::vector<int32_t>& producer,
                const std::set<int32_t>& forward_ops, const std::set<int32_t>& needed) {
  // Domain: needed values and, through recomputable ops of the forward task,
  // their non-free ancestors.
  std::vector<int32_t> domain;
  std::unordered_map<int32_t, int> node;  // value -> index in domain
  std::vector<int32_t> work(needed.begin(), needed.end());
  for (int32_t v : work) node.emplace(v, 0);
  while (!work.empty()) {
    int32_t v = work.back();
    work.pop_back();
    domain.push_back(v);
    int32_t op = producer[v];
    if (op < 0 || !forward_ops.count(op) || !is_recomputable(p.ops[op])) continue;
    for (int32_t u : p.ops[op].inputs) {
      if (is_free(p, u) || node.count(u)) continue;
      node.emplace(u, 0);
      work.push_back(u);
    }
  }
  std::sort(domain.begin(), domain.end());
  for (size_t i = 0; i < domain.size(); ++i) node[domain[i]] = static_cast<int>(i);
  // Node 2i: value i "computed"; 2i+1: value i "available to the backward";
  // the edge between them costs its bytes (stashing it).
  const int n = static_cast<int>(domain.size());
  const int src = 2 * n, sink = 2 * n + 1;
  MaxFlow g(2 * n + 2);
  for (int i = 0; i < n; ++i) {
    int32_t v = domain[i];
    g.edge(2 * i, 2 * i + 1, std::max<int64_t>(p.values[v].bytes, 1));
    int32_t op = producer[v];
    if (op < 0 || !forward_ops.count(op) || !is_recomputable(p.ops[op])) {
      g.edge(src, 2 * i, MaxFlow::kInf);  // must come from the forward task
    } else {
      for (int32_t u : p.ops[op].inputs) {
        if (!is_free(p, u)) g.edge(2 * node[u] + 1, 2 * i, MaxFlow::kInf);
      }
    }
    if (needed.count(v)) g.edge(2 * i + 1, sink, MaxFlow::kInf);
  }
  g.run(src, sink);
  // The minimum cut closest to the sink: the fewest recomputed ops among the
  // cuts of least stashed bytes.
  std::vector<bool> t_side = g.reaches(sink);
  Remat out;
  std::set<int32_t> ops;
  std::vector<int32_t> stack(needed.begin(), needed.end());
  std::unordered_set<int32_t> seen(needed.begin(), needed.end());
  while (!stack.empty()) {
    int32_t v = stack.back();
    stack.pop_back();
    int i = node[v];
    if (!t_side[2 * i]) {  // computed by the forward task: stash it
      out.stash.push_back(v);
      continue;
    }
    int32_t op = producer[v];
    ops.insert(op);
    for (int32_t u : p.ops[op].inputs) {
      if (!is_free(p, u) && seen.insert(u).second) stack.push_back(u);
    }
  }
  std::sort(out.stash.begin(), out.stash.end());
  out.recompute.assign(ops.begin(), ops.end());
  return out;
}

}  // namespace baton
