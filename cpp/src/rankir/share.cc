// Pass: which ranks can share one compiled program (rank_program.h). A rank's
// shape is the set of its unit shapes and transfer shapes with everything
// that a shared program takes as data left out:
//   unit: per task its kind and the index of its stage among the rank's
//     stages; per buffer read or written its kind, its stage relative to the
//     unit's first task (skip buffers: the edge's ends relative to it) and its
//     microbatch relative to the first task's; whether it is offloaded;
//   transfer: direction, peer - rank, buffer kind, the index of the rank's
//     own stage that makes or reads the buffer and the buffer's stage
//     relative to it.
// Ranks of equal shape form one class.
#include <algorithm>
#include <map>
#include <set>

#include "baton/rank_program.h"

namespace baton {

namespace {

using Shape = std::vector<int32_t>;

int32_t local_index(const RankProgram& p, int32_t stage) {
  const auto it = std::find(p.stages.begin(), p.stages.end(), stage);
  return it == p.stages.end() ? -1 : static_cast<int32_t>(it - p.stages.begin());
}

// kind, then the buffer's stage (or skip edge ends) relative to `stage`.
void buffer_shape(const Plan& plan, const BufferKey& k, int32_t stage, Shape& out) {
  out.push_back(static_cast<int32_t>(k.kind));
  if (k.kind == BufKind::Skip || k.kind == BufKind::SkipGrad) {
    const SkipEdge& e = plan.skips[k.stage];
    out.push_back(e.from - stage);
    out.push_back(e.to - stage);
  } else {
    out.push_back(k.stage - stage);
  }
}

std::set<Shape> rank_shape(const Plan& plan, const RankProgram& p) {
  std::set<Shape> shape;
  for (const Unit& u : p.units) {
    Shape s{0};
    const Task& t0 = u.tasks.front();
    for (const Task& t : u.tasks) {
      s.push_back(static_cast<int32_t>(t.kind));
      s.push_back(local_index(p, t.stage));
    }
    for (const auto* list : {&u.reads, &u.writes}) {
      s.push_back(-1);  // separator between reads and writes
      for (int32_t b : *list) {
        const BufferKey& k = p.buffers[b].key;
        buffer_shape(plan, k, t0.stage, s);
        s.push_back(k.microbatch - t0.microbatch);
        if (p.buffers[b].offload >= 0) s.push_back(-2);  // offloaded (offload.cc)
      }
    }
    shape.insert(std::move(s));
  }
  for (const Transfer& t : p.transfers) {
    const RankBuffer& b = p.buffers[t.buffer];
    const int32_t own =
        t.dir == TransferDir::Send ? plan.producer_stage(b.id) : plan.consumer_stage(b.id);
    Shape s{1, static_cast<int32_t>(t.dir), t.peer - p.rank, local_index(p, own)};
    buffer_shape(plan, b.key, own, s);
    shape.insert(std::move(s));
  }
  shape.insert(Shape{2, static_cast<int32_t>(p.stages.size())});
  return shape;
}

}  // namespace

std::vector<std::vector<int32_t>> share_classes(const Plan& plan,
                                                std::vector<RankProgram>& programs) {
  std::map<std::set<Shape>, int32_t> index;
  std::vector<std::vector<int32_t>> classes;
  for (RankProgram& p : programs) {
    auto [it, fresh] = index.try_emplace(rank_shape(plan, p), static_cast<int32_t>(classes.size()));
    if (fresh) classes.emplace_back();
    classes[it->second].push_back(p.rank);
    p.share_class = it->second;
  }
  return classes;
}

}  // namespace baton
