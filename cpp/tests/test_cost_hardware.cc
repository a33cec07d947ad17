// Hardware JSON (errors name the key path) and the collective formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "baton/collectives.h"
#include "baton/error.h"
#include "baton/hardware.h"

namespace {

const char* kH100 = R"({
  "name": "h100", "gpus_per_node": 8, "peak_bf16": 9.89e14, "peak_fp8": 1.979e15,
  "hbm_bandwidth": 3.35e12, "hbm_bytes": 85899345920, "reserved_bytes": 4294967296,
  "intra": {"bandwidth": 4.5e11, "latency": 3e-6},
  "inter": {"bandwidth": 5e10, "latency": 8e-6},
  "efficiency": 0.5, "efficiency_note": "test",
  "sources": {"peak_bf16": "datasheet"}
})";

std::string with(const std::string& from, const std::string& to) {
  std::string s = kH100;
  const auto k = s.find(from);
  EXPECT_NE(k, std::string::npos) << from;
  return s.replace(k, from.size(), to);
}

template <class E>
std::string error_of(const std::string& text) {
  try {
    baton::Hardware::from_json(text);
  } catch (const E& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(Hardware, ParsesAndRoundTrips) {
  const baton::Hardware h = baton::Hardware::from_json(kH100);
  EXPECT_EQ(h.gpus_per_node, 8);
  EXPECT_DOUBLE_EQ(h.intra.bandwidth, 4.5e11);
  EXPECT_EQ(h.memory_budget(), 85899345920 - 4294967296);
  EXPECT_DOUBLE_EQ(h.achieved_flops(false), 9.89e14 * 0.5);
  EXPECT_DOUBLE_EQ(h.achieved_flops(true), 1.979e15 * 0.5);
  EXPECT_EQ(h.sources.at("peak_bf16"), "datasheet");
  EXPECT_EQ(baton::Hardware::from_json(h.to_json()), h);
}

TEST(Hardware, ClockRatioAndWaveQuantizationRoundTrip) {
  const baton::Hardware h = baton::Hardware::from_json(with(
      "\"efficiency\": 0.5,",
      "\"clock_ratio\": 0.894, \"wave_quantization\": {\"sms\": 108, \"tiles\": [[256, 128], "
      "[128, 128]]}, \"efficiency\": 0.5,"));
  EXPECT_DOUBLE_EQ(h.clock_ratio, 0.894);
  EXPECT_EQ(h.sms, 108);
  ASSERT_EQ(h.gemm_tiles.size(), 2u);
  EXPECT_DOUBLE_EQ(h.gemm_tiles[0].first, 256);
  EXPECT_DOUBLE_EQ(h.achieved_flops(false), 9.89e14 * 0.5 * 0.894);
  EXPECT_EQ(baton::Hardware::from_json(h.to_json()), h);
  EXPECT_NE(error_of<baton::ConfigError>(with("\"efficiency\": 0.5,",
                                               "\"clock_ratio\": 1.1, \"efficiency\": 0.5,"))
                .find("clock_ratio must be in (0, 1]"),
            std::string::npos);
  EXPECT_NE(error_of<baton::FormatError>(
                with("\"efficiency\": 0.5,",
                     "\"wave_quantization\": {\"sms\": 108, \"tile\": [1, 2]}, \"efficiency\": 0.5,"))
                .find("unknown key 'wave_quantization.tile'"),
            std::string::npos);
  EXPECT_NE(error_of<baton::FormatError>(
                with("\"efficiency\": 0.5,",
                     "\"wave_quantization\": {\"sms\": 108, \"tiles\": [[1]]}, \"efficiency\": 0.5,"))
                .find("'wave_quantization.tiles[0]' must be [rows, cols]"),
            std::string::npos);
  EXPECT_NE(error_of<baton::ConfigError>(
                with("\"efficiency\": 0.5,",
                     "\"wave_quantization\": {\"sms\": 108, \"tiles\": []}, \"efficiency\": 0.5,"))
                .find("wave_quantization needs sms >= 1 and at least one tile"),
            std::string::npos);
}

TEST(Hardware, NamedAttentionKernels) {
  // The default curve and a named one ("fa2"), each a fraction of peak by sequence length.
  const baton::Hardware h = baton::Hardware::from_json(with(
      "\"efficiency\": 0.5,",
      "\"attention\": {\"fwd\": [[1024, 0.4], [8192, 0.5]], \"bwd_ratio\": 0.8}, "
      "\"attention_kernels\": {\"fa2\": {\"fwd\": [[1024, 0.25], [8192, 0.3]], "
      "\"bwd_ratio\": 0.75}}, \"efficiency\": 0.5,"));
  const double rate = 9.89e14 * 0.5;
  EXPECT_DOUBLE_EQ(h.attention_seconds(1e12, 8192, false), 1e12 / (rate * 0.5));
  EXPECT_DOUBLE_EQ(h.attention_seconds(1e12, 8192, false, "fa2"), 1e12 / (rate * 0.3));
  EXPECT_DOUBLE_EQ(h.attention_seconds(1e12, 1024, true, "fa2"), 1e12 / (rate * 0.25 * 0.75));
  EXPECT_EQ(baton::Hardware::from_json(h.to_json()), h);
  try {
    h.attention_seconds(1e12, 8192, false, "fa4");
    FAIL() << "no error";
  } catch (const baton::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("no attention kernel 'fa4' (attention_kernels: fa2)"),
              std::string::npos);
  }
  EXPECT_NE(error_of<baton::ConfigError>(with(
                "\"efficiency\": 0.5,",
                "\"attention_kernels\": {\"fa2\": {\"fwd\": [[1024, 1.5]]}}, \"efficiency\": 0.5,"))
                .find("attention_kernels.fa2.fwd must be fractions <= 1"),
            std::string::npos);
  EXPECT_NE(error_of<baton::FormatError>(with(
                "\"efficiency\": 0.5,",
                "\"attention_kernels\": {\"fa2\": {\"fw\": []}}, \"efficiency\": 0.5,"))
                .find("unknown key 'attention_kernels.fa2.fw'"),
            std::string::npos);
}

TEST(Hardware, ErrorsNameTheKeyPath) {
  EXPECT_NE(error_of<baton::FormatError>(with("\"latency\": 3e-6", "\"latency\": \"x\""))
                .find("'intra.latency' must be a number"),
            std::string::npos);
  EXPECT_NE(error_of<baton::FormatError>(with("\"latency\": 8e-6", "\"lat\": 8e-6"))
                .find("unknown key 'inter.lat'"),
            std::string::npos);
  EXPECT_NE(error_of<baton::FormatError>(with("\"gpus_per_node\": 8,", ""))
                .find("'gpus_per_node' is required"),
            std::string::npos);
  EXPECT_NE(error_of<baton::FormatError>(with("\"name\"", "\"nmae\"")).find("unknown key 'nmae'"),
            std::string::npos);
  EXPECT_NE(error_of<baton::ConfigError>(with("\"bandwidth\": 5e10", "\"bandwidth\": 0"))
                .find("inter.bandwidth must be finite and > 0"),
            std::string::npos);
  EXPECT_NE(error_of<baton::ConfigError>(with("\"efficiency\": 0.5", "\"efficiency\": 1.5"))
                .find("efficiency must be in (0, 1]"),
            std::string::npos);
  EXPECT_NE(error_of<baton::FormatError>("{\"gpus_per_node\": 8,").find("line"),
            std::string::npos);
  EXPECT_NE(error_of<baton::FormatError>(with("\"peak_bf16\": \"datasheet\"", "\"peak_bf16\": 3"))
                .find("'sources.peak_bf16' must be a string"),
            std::string::npos);
}

TEST(Collectives, Formulas) {
  const baton::LinkSpec l{1e9, 1e-5};
  const double S = 8e6;
  for (int n : {2, 4, 8, 64}) {
    const double ring = 2.0 * (n - 1) / n * S / 1e9 + 2.0 * (n - 1) * 1e-5;
    const double tree = 2.0 * S / 1e9 + 2.0 * std::ceil(std::log2(n)) * 1e-5;
    EXPECT_DOUBLE_EQ(baton::ring_all_reduce_time(S, n, l), ring);
    EXPECT_DOUBLE_EQ(baton::tree_all_reduce_time(S, n, l), tree);
    EXPECT_DOUBLE_EQ(baton::all_reduce_time(S, n, l), std::min(ring, tree));
    const double gather = (n - 1.0) / n * S / 1e9 + (n - 1) * 1e-5;
    EXPECT_DOUBLE_EQ(baton::all_gather_time(S, n, l), gather);
    EXPECT_DOUBLE_EQ(baton::reduce_scatter_time(S, n, l), gather);
    EXPECT_DOUBLE_EQ(baton::all_to_all_time(S, n, l), gather);
    EXPECT_DOUBLE_EQ(baton::ring_all_reduce_bytes(S, n), 2.0 * (n - 1) / n * S);
  }
  // Small messages over many ranks: the tree's log latency wins.
  EXPECT_LT(baton::all_reduce_time(1e3, 1024, l), baton::ring_all_reduce_time(1e3, 1024, l));
  EXPECT_EQ(baton::all_reduce_time(S, 1, l), 0.0);
  EXPECT_EQ(baton::all_gather_time(S, 1, l), 0.0);
  EXPECT_DOUBLE_EQ(baton::p2p_time(S, l), S / 1e9 + 1e-5);
  EXPECT_THROW(baton::all_gather_time(S, 0, l), baton::ConfigError);
  EXPECT_THROW(baton::all_gather_time(-1, 2, l), baton::ConfigError);
}

TEST(Collectives, AxisPlacement) {
  const baton::Hardware h = baton::Hardware::from_json(kH100);
  EXPECT_EQ(&baton::axis_link(h, 1, 8), &h.intra);   // TP 8: one node
  EXPECT_EQ(&baton::axis_link(h, 1, 16), &h.inter);  // TP 16 spans two nodes
  EXPECT_EQ(&baton::axis_link(h, 2, 4), &h.intra);   // stride 2 x 4 ranks = 8
  EXPECT_EQ(&baton::axis_link(h, 8, 2), &h.inter);   // DP outside TP 8
  EXPECT_EQ(&baton::axis_link(h, 4, 4), &h.inter);   // half-node steps cross nodes
  EXPECT_THROW(baton::axis_link(h, 0, 2), baton::ConfigError);
}

}  // namespace
