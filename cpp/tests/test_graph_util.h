// Builds small Programs by hand for the graph-pass tests (test_graph*.cc):
// the same shapes the JAX frontend exports, without JAX.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "baton/graph.h"

namespace baton {

struct ProgramBuilder {
  Program p;
  Region region = Region::Loop;  // of the ops added next
  int64_t bytes = 16;            // of every value made without an explicit size
  int val(ValueKind k = ValueKind::Intermediate, int64_t size = -1) {
    Value v;
    v.kind = k;
    v.shape = {2, 2};
    v.dtype = "float32";
    v.bytes = size >= 0 ? size : bytes;
    return p.add_value(v);
  }
  int op(const std::string& name, std::vector<int32_t> ins, double cost = 1.0,
         OpKind kind = OpKind::Compute) {
    return add(name, std::move(ins), cost, kind, bytes);
  }
  // An op whose output has `size` bytes.
  int sized(const std::string& name, std::vector<int32_t> ins, int64_t size) {
    return add(name, std::move(ins), 1.0, OpKind::Compute, size);
  }
  int marker(int k, bool backward, int in) {
    Op o;
    o.kind = OpKind::Boundary;
    o.region = Region::Loop;
    o.name = "stage_boundary";
    o.inputs = {in};
    o.outputs = {val()};
    o.boundary = k;
    o.backward = backward;
    p.add_op(o);
    return o.outputs[0];
  }
  int loop_in(ValueKind k) {
    int outer = val(ValueKind::StepInput);
    int body = val(k);
    p.loop_inputs.push_back({body, outer});
    return body;
  }
  int loop_out(int body, Reduce r) {
    int outer = val();
    p.loop_outputs.push_back({body, outer, r});
    return outer;
  }

 private:
  int add(const std::string& name, std::vector<int32_t> ins, double cost, OpKind kind,
          int64_t size) {
    Op o;
    o.kind = kind;
    o.region = region;
    o.name = name;
    o.inputs = std::move(ins);
    o.outputs = {val(ValueKind::Intermediate, size)};
    o.cost = cost;
    p.add_op(o);
    return o.outputs[0];
  }
};

}  // namespace baton
