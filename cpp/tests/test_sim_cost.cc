// CostModel: lookup, validation, JSON round trip and JSON errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "baton/autoplan.h"
#include "baton/cost.h"
#include "baton/error.h"
#include "test_plan_util.h"

namespace baton {
namespace {

using testing::error_of;

TEST(SimCost, StageFallsBackToDefault) {
  CostModel c = CostModel::uniform(1, 2, 3, 4);
  c.stages.resize(2, c.default_stage);
  c.stages[1].f = 7;
  EXPECT_EQ(c.stage(1).f, 7);
  EXPECT_EQ(c.stage(0).f, 1);
  EXPECT_EQ(c.stage(5).w, 4);  // not listed
  EXPECT_EQ(c.stage(-1).i, 3);
}

TEST(SimCost, UniformSetsTimesOnly) {
  CostModel c = CostModel::uniform(1.5, 3, 2, 1);
  EXPECT_EQ(c.default_stage.f, 1.5);
  EXPECT_EQ(c.default_stage.b, 3);
  EXPECT_EQ(c.default_stage.i, 2);
  EXPECT_EQ(c.default_stage.w, 1);
  EXPECT_TRUE(c.stages.empty());
  EXPECT_EQ(c.fused_factor, 1.0);
}

TEST(SimCost, JsonRoundTrip) {
  CostModel c = CostModel::uniform(1.25, 2.5, 1.0 / 3.0, 0.1);
  c.default_stage.stash_bytes = 123456789012;
  c.stages.push_back(c.default_stage);
  c.stages.push_back(c.default_stage);
  c.stages[1].act_bytes = 77;
  c.stages[1].wgrad_bytes = 5;
  c.link = {0.5, 1e9};
  c.fused_factor = 0.8;
  const std::string text = c.to_json();
  EXPECT_EQ(CostModel::from_json(text), c);
  auto j = nlohmann::json::parse(text);
  EXPECT_EQ(j["stages"].size(), 2u);
  EXPECT_EQ(j["link"]["bandwidth"].get<double>(), 1e9);
}

// Found by fuzzing (cpp/fuzz/regressions): a number beyond a double is refused
// by nlohmann as out of range, not as a syntax error; it is a FormatError too.
TEST(SimCost, JsonNumberOverflowIsAFormatError) {
  EXPECT_NE(error_of<FormatError>([] {
              CostModel::from_json(R"({"default": {"f": 1e999}})");
            }).find("cost JSON: number overflow parsing '1e999'"),
            std::string::npos);
  EXPECT_NE(error_of<FormatError>([] {
              SegmentCosts::from_json("77707e777777");
            }).find("segment costs JSON: number overflow"),
            std::string::npos);
}

TEST(SimCost, JsonPartialAndStageInheritsDefault) {
  CostModel c = CostModel::from_json(R"({
    "default": {"f": 2, "b": 4, "act_bytes": 100},
    "stages": [{"f": 3}, {}],
    "link": {"latency": 0.25}
  })");
  EXPECT_EQ(c.default_stage.f, 2);
  EXPECT_EQ(c.default_stage.i, 1);  // untouched default
  ASSERT_EQ(c.stages.size(), 2u);
  EXPECT_EQ(c.stages[0].f, 3);
  EXPECT_EQ(c.stages[0].b, 4);  // inherited from "default"
  EXPECT_EQ(c.stages[0].act_bytes, 100);
  EXPECT_EQ(c.stages[1], c.default_stage);
  EXPECT_EQ(c.link.latency, 0.25);
  EXPECT_EQ(c.link.bandwidth, 0);
  EXPECT_EQ(CostModel::from_json("{}"), CostModel{});
}

TEST(SimCost, JsonUnknownKeysNamed) {
  EXPECT_NE(
      error_of<FormatError>([] { CostModel::from_json(R"({"defualt": {}})"); }).find("'defualt'"),
      std::string::npos);
  EXPECT_NE(error_of<FormatError>([] {
              CostModel::from_json(R"({"stages": [{}, {"fo": 1}]})");
            }).find("'stages[1].fo'"),
            std::string::npos);
  EXPECT_NE(error_of<FormatError>([] {
              CostModel::from_json(R"({"link": {"lat": 1}})");
            }).find("'link.lat'"),
            std::string::npos);
}

TEST(SimCost, JsonBadTypesNamed) {
  EXPECT_NE(error_of<FormatError>([] {
              CostModel::from_json(R"({"default": {"f": "1"}})");
            }).find("'default.f' must be a number"),
            std::string::npos);
  EXPECT_NE(error_of<FormatError>([] {
              CostModel::from_json(R"({"stages": {}})");
            }).find("'stages' must be an array"),
            std::string::npos);
  EXPECT_NE(error_of<FormatError>([] {
              CostModel::from_json(R"({"stages": [3]})");
            }).find("'stages[0]' must be an object"),
            std::string::npos);
  EXPECT_NE(error_of<FormatError>([] {
              CostModel::from_json(R"({"default": {"act_bytes": 1.5}})");
            }).find("'default.act_bytes' must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of<FormatError>([] { CostModel::from_json("[1, 2]"); }).find("must be an object"),
            std::string::npos);
  // An integral float is accepted as a byte count.
  EXPECT_EQ(CostModel::from_json(R"({"default": {"act_bytes": 2.0}})").default_stage.act_bytes, 2);
}

TEST(SimCost, JsonSyntaxErrorHasLineAndColumn) {
  try {
    CostModel::from_json("{\n  \"default\": {\"f\": 1,}\n}");
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_EQ(e.line, 2);
    EXPECT_GT(e.column, 1);
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
  }
}

TEST(SimCost, ValidateNamesField) {
  CostModel c;
  c.stages.resize(4);
  c.stages[3].f = -1;
  EXPECT_NE(error_of<ConfigError>([&] { c.validate(); }).find("stages[3].f"), std::string::npos);
  c.stages[3].f = 1;
  c.validate();
  c.link.bandwidth = std::numeric_limits<double>::infinity();
  EXPECT_NE(error_of<ConfigError>([&] { c.validate(); }).find("link.bandwidth"), std::string::npos);
  c.link.bandwidth = 0;
  c.default_stage.grad_bytes = -3;
  EXPECT_NE(error_of<ConfigError>([&] { c.validate(); }).find("default.grad_bytes"),
            std::string::npos);
  c.default_stage.grad_bytes = 3;
  c.fused_factor = 0;
  EXPECT_NE(error_of<ConfigError>([&] { c.validate(); }).find("fused_factor"), std::string::npos);
  // from_json validates too.
  EXPECT_NE(error_of<ConfigError>([] {
              CostModel::from_json(R"({"link": {"latency": -2}})");
            }).find("link.latency"),
            std::string::npos);
}

}  // namespace
}  // namespace baton
