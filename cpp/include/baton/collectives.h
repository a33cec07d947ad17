// Collective communication costs over one link class (docs/SCALE.md,
// "Collectives"). Collectives run at the link's NCCL bus bandwidth
// (LinkSpec::collective_bandwidth, bw below), point-to-point at its bandwidth. `bytes` is always the size of the full buffer one rank
// holds: the all-reduced tensor, the gathered output of an all-gather, the
// input of a reduce-scatter, everything one rank sends and keeps in an
// all-to-all. n ranks take part; n == 1 costs 0.
//
//   ring all-reduce     2 (n-1)/n * bytes / bw + 2 (n-1) * latency
//   tree all-reduce     2 bytes / bw + 2 ceil(log2 n) * latency   (double binary tree)
//   all-reduce          min(ring, tree)
//   all-gather          (n-1)/n * bytes / bw + (n-1) * latency    (ring)
//   reduce-scatter      (n-1)/n * bytes / bw + (n-1) * latency    (ring)
//   all-to-all          (n-1)/n * bytes / bw + (n-1) * latency    (pairwise exchange)
//   p2p                 bytes / bw + latency
//
// A mesh axis of `size` ranks whose neighbours are `stride` GPUs apart (the
// product of the sizes of the axes inside it: TP innermost, then expert, then
// data, then pipeline outermost) runs on the intra-node link when all its
// ranks lie in one node (stride * size <= gpus_per_node), else on the
// inter-node link (its ring crosses nodes, and the slowest hop paces a ring).
#pragma once
#include "baton/hardware.h"

namespace baton {

const LinkSpec& axis_link(const Hardware& hw, int stride, int size);

double ring_all_reduce_time(double bytes, int n, const LinkSpec& link);
double tree_all_reduce_time(double bytes, int n, const LinkSpec& link);
double all_reduce_time(double bytes, int n, const LinkSpec& link);
double all_gather_time(double bytes, int n, const LinkSpec& link);
double reduce_scatter_time(double bytes, int n, const LinkSpec& link);
double all_to_all_time(double bytes, int n, const LinkSpec& link);
double p2p_time(double bytes, const LinkSpec& link);

// Seconds a collective of `comm` seconds adds when overlapped with `compute`
// seconds of work: the part the compute cannot hide, max(0, comm - compute),
// plus `contention` * min(comm, compute), the slowdown of the compute it hides
// behind (NCCL's kernels occupy SMs). Throws ConfigError on negative inputs
// or contention outside [0, 1).
double overlap_exposed(double comm, double compute, double contention);

// Bytes one rank sends in a ring all-reduce (2 (n-1)/n * bytes) and in a ring
// all-gather / reduce-scatter / all-to-all ((n-1)/n * bytes).
double ring_all_reduce_bytes(double bytes, int n);
double ring_gather_bytes(double bytes, int n);

}  // namespace baton
