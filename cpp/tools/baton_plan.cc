// baton-plan: build (or load) a pipeline schedule, lower it, verify it,
// simulate it and print the summary table; optionally write pictures.
//
//   baton-plan --schedule zbv --ranks 4 --microbatches 8 [--virtual-stages 2]
//              [--costs costs.json] [--svg t.svg] [--trace t.json] [--grid]
//              [--print-plan] [--save s.txt | --load s.txt]
//   baton-plan --auto --segments costs.json --ranks 8 [--memory 20GiB] [--top 10]
//              [--families 1f1b,zbv] [--microbatches 4,8,16] [--remat keep,min]
//              [--offload yes --host-memory 200GiB] [--json result.json]
//   baton-plan --profile model.json --cluster h100.json --gpus 512 --global-batch 1024
//              [--fp8] [--pp 8] [--tp 8] [--fsdp yes|no] [--top 10] [--json plans.json]
//   baton-plan --model llama3-70b --cluster h100 --gpus 512 --global-batch 1024 --seq 8192
//
// --profile plans a training run at cluster scale (cluster.h, docs/SCALE.md):
// the degrees, then cuts, schedule, microbatches and remat by the same search.
// --model (a model name or a Python model definition) needs JAX to trace the
// model abstractly: baton-plan hands the whole command line to the
// `baton-plan-model` script installed next to it (python/baton/scale/cli.py),
// which traces, then calls this core through the bindings.
//
// --auto searches stage boundaries, schedule, microbatch count and remat
// (autoplan.h) and prints the ranked table; it exits 1 when nothing fits.
//
// Exit status: 0 success, 1 bad input (unknown schedule, generator refusal,
// unreadable file, parse error), 2 the plan failed verification.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <unistd.h>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "baton/autoplan.h"
#include "baton/cluster.h"
#include "baton/cost.h"
#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/rank_program.h"
#include "baton/render.h"
#include "baton/schedule.h"
#include "baton/sim.h"
#include "baton/text_format.h"
#include "baton/verify.h"

namespace {

constexpr int kExitInput = 1;
constexpr int kExitVerify = 2;

// An error that the CLI reports as one line and an exit status.
struct CliError {
  std::string message;
  int code = kExitInput;
};

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw CliError{fmt::format("cannot read {} '{}': {}", what, path, std::strerror(errno))};
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw CliError{fmt::format("cannot read {} '{}'", what, path)};
  return ss.str();
}

void write_file(const std::string& path, const std::string& text, const char* what) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    throw CliError{fmt::format("cannot write {} '{}': {}", what, path, std::strerror(errno))};
  }
  out << text;
  out.close();
  if (!out) throw CliError{fmt::format("cannot write {} '{}'", what, path)};
}

std::string first_line(const std::string& s) {
  auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

struct Options {
  std::string schedule;
  int ranks = 0;
  std::string microbatches;  // one count, or a comma list with --auto
  bool autoplan = false;
  std::string segments;
  std::string memory;
  int top = 10;
  std::string families;
  std::string remat;
  std::string interleaved_v;
  int max_microbatches = 0;
  std::string json;
  double gap = 0;
  bool update_in_place = false;
  std::string offload;      // --auto: "yes" to search offload; --profile: yes|no (default: by host link)
  std::string host_memory;  // --auto: host bytes per rank offload may hold
  int virtual_stages = 1;
  std::string costs;
  std::string svg;
  std::string trace;
  bool grid = false;
  int grid_width = 0;
  bool print_plan = false;
  bool print_rank_ir = false;
  std::string save;
  std::string load;
  double time_unit_us = 1000.0;
  std::string profile;
  std::string cluster;
  int gpus = 0;
  int64_t global_batch = 0;
  bool fp8 = false;
  std::string pp, tp, fsdp;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : s + ",") {
    if (ch == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else if (ch != ' ') {
      cur += ch;
    }
  }
  return out;
}

int parse_count(const std::string& s, const char* what) {
  int v = 0;
  size_t used = 0;
  try {
    v = std::stoi(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (s.empty() || used != s.size())
    throw CliError{fmt::format("{} must be an integer (got '{}')", what, s)};
  return v;
}

int run_auto(const Options& o, bool have_ranks) {
  if (o.segments.empty()) throw CliError{"--segments is required with --auto"};
  if (!have_ranks) throw CliError{"--ranks is required with --auto"};
  const baton::SegmentCosts costs =
      baton::SegmentCosts::from_json(read_file(o.segments, "segment cost file"));
  baton::AutoplanOptions ao;
  ao.ranks = o.ranks;
  ao.memory = o.memory.empty() ? 0 : baton::parse_bytes(o.memory);
  ao.top = o.top;
  ao.families = split_list(o.families);
  for (const std::string& m : split_list(o.microbatches))
    ao.microbatches.push_back(parse_count(m, "--microbatches"));
  for (const std::string& m : split_list(o.remat)) ao.remat_modes.push_back(baton::parse_remat(m));
  if (!o.interleaved_v.empty()) {
    ao.interleaved_v.clear();
    for (const std::string& v : split_list(o.interleaved_v))
      ao.interleaved_v.push_back(parse_count(v, "--interleaved-v"));
  }
  ao.max_microbatches = o.max_microbatches;
  ao.gap = o.gap;
  ao.update_in_place = o.update_in_place;
  if (o.offload == "yes")
    ao.offload = true;
  else if (!o.offload.empty() && o.offload != "no")
    throw CliError{fmt::format("--offload must be yes or no (got '{}')", o.offload)};
  ao.host_memory = o.host_memory.empty() ? 0 : baton::parse_bytes(o.host_memory);
  const baton::AutoplanResult r = baton::autoplan(costs, ao);
  if (!o.json.empty()) write_file(o.json, r.to_json() + "\n", "result file");
  std::cout << baton::autoplan_table(r, ao.memory);
  std::cout.flush();
  return 0;
}

int run_cluster(const Options& o) {
  if (o.cluster.empty()) throw CliError{"--cluster is required with --profile"};
  if (o.gpus < 1) throw CliError{"--gpus (>= 1) is required with --profile"};
  if (o.global_batch < 1) throw CliError{"--global-batch (>= 1) is required with --profile"};
  const baton::ModelProfile model =
      baton::ModelProfile::from_json(read_file(o.profile, "model profile"));
  const baton::Hardware hw = baton::Hardware::from_json(read_file(o.cluster, "hardware file"));
  baton::ClusterOptions co;
  co.gpus = o.gpus;
  co.global_batch = o.global_batch;
  co.fp8 = o.fp8;
  co.top = o.top;
  co.families = split_list(o.families);
  for (const std::string& v : split_list(o.pp)) co.pp_choices.push_back(parse_count(v, "--pp"));
  for (const std::string& v : split_list(o.tp)) co.tp_choices.push_back(parse_count(v, "--tp"));
  if (o.fsdp == "yes") co.fsdp_mode = 1;
  else if (o.fsdp == "no") co.fsdp_mode = 0;
  else if (!o.fsdp.empty()) throw CliError{fmt::format("--fsdp must be yes or no (got '{}')", o.fsdp)};
  if (o.offload == "yes") co.offload = 1;
  else if (o.offload == "no") co.offload = 0;
  else if (!o.offload.empty()) throw CliError{fmt::format("--offload must be yes or no (got '{}')", o.offload)};
  const baton::ClusterResult r = baton::plan_cluster(model, hw, co);
  if (!o.json.empty()) write_file(o.json, r.to_json() + "\n", "result file");
  std::cout << fmt::format("{}: {} GPUs ({}), global batch {} x {} tokens\n", model.name, co.gpus,
                           hw.name, co.global_batch, model.seq);
  std::cout << baton::cluster_table(r, hw);
  std::cout.flush();
  return 0;
}

// `--model` needs the Python tracer: replace this process by the
// baton-plan-model script installed beside this binary.
int delegate_model(int argc, char** argv) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::filesystem::path script = (ec ? std::filesystem::path(argv[0]) : self)
                                           .parent_path() / "baton-plan-model";
  std::vector<char*> args;
  std::string s = script.string();
  args.push_back(s.data());
  for (int k = 1; k < argc; ++k) args.push_back(argv[k]);
  args.push_back(nullptr);
  execv(s.c_str(), args.data());
  std::cerr << fmt::format("baton-plan: error: --model needs '{}' (installed with the Python "
                           "package): {}\n",
                           s, std::strerror(errno));
  return kExitInput;
}

int run(const Options& o, bool have_ranks, bool have_microbatches) {
  if (o.autoplan) return run_auto(o, have_ranks);
  if (!o.profile.empty()) return run_cluster(o);
  baton::Schedule schedule;
  if (!o.load.empty()) {
    schedule = baton::load_schedule(read_file(o.load, "schedule file"));
    if (have_ranks && o.ranks != schedule.num_ranks) {
      throw CliError{fmt::format("schedule file '{}' is for {} ranks, but --ranks {} was given",
                                 o.load, schedule.num_ranks, o.ranks)};
    }
    if (have_microbatches &&
        parse_count(o.microbatches, "--microbatches") != schedule.num_microbatches) {
      throw CliError{
          fmt::format("schedule file '{}' is for {} microbatches, but --microbatches {} was given",
                      o.load, schedule.num_microbatches, o.microbatches)};
    }
  } else {
    if (o.schedule.empty()) throw CliError{"--schedule or --load is required"};
    if (!have_ranks) throw CliError{"--ranks is required with --schedule"};
    if (!have_microbatches) throw CliError{"--microbatches is required with --schedule"};
    schedule = baton::make_schedule(
        o.schedule, o.ranks, parse_count(o.microbatches, "--microbatches"), o.virtual_stages);
  }
  if (!o.save.empty()) write_file(o.save, baton::save_schedule(schedule), "schedule file");

  baton::CostModel costs;
  if (!o.costs.empty()) costs = baton::CostModel::from_json(read_file(o.costs, "cost file"));
  costs.validate();

  const baton::Plan plan = baton::lower(schedule);
  if (o.print_plan) std::cout << plan.to_text() << "\n";

  const baton::VerifyReport report = baton::verify(plan);
  if (!report.ok()) {
    std::cout << report.to_string() << "\n";
    throw CliError{fmt::format("verification failed ({} violation{}): {}", report.violations.size(),
                               report.violations.size() == 1 ? "" : "s",
                               first_line(report.violations.front().message)),
                   kExitVerify};
  }

  // What is simulated and drawn is what runs: the rank programs.
  const baton::RankIR ir = baton::build_rank_ir(plan);
  if (o.print_rank_ir) std::cout << ir.to_text() << "\n";
  const baton::SimResult result = baton::simulate(ir, costs);
  if (!o.svg.empty()) write_file(o.svg, baton::to_svg(plan, result), "SVG file");
  if (!o.trace.empty()) {
    write_file(o.trace, baton::to_chrome_trace(plan, result, o.time_unit_us), "trace file");
  }
  if (o.grid) std::cout << baton::to_text_grid(plan, result, o.grid_width) << "\n";
  std::cout << baton::summary_table(plan, result, &report);
  std::cout.flush();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int k = 1; k < argc; ++k) {
    const std::string_view a = argv[k];
    if (a == "--model" || a.rfind("--model=", 0) == 0) return delegate_model(argc, argv);
  }
  CLI::App app{"Build, lower, verify and simulate a pipeline schedule.", "baton-plan"};
  Options o;
  auto* sched = app.add_option("-s,--schedule", o.schedule,
                               "Schedule generator: gpipe 1f1b eager1f1b interleaved zbh1 zbh2 "
                               "zbv dualpipev");
  auto* ranks = app.add_option("-p,--ranks", o.ranks, "Pipeline ranks");
  auto* mbs = app.add_option("-m,--microbatches", o.microbatches,
                             "Microbatches per step (with --auto: comma list to try)");
  app.add_flag("--auto", o.autoplan,
               "Search stage cuts, schedule, microbatches and remat for --segments");
  app.add_option("--segments", o.segments, "Segment cost JSON file (--auto)");
  app.add_option("--memory", o.memory, "Memory budget per rank, e.g. 20GiB (--auto; 0: unlimited)");
  app.add_option("--top", o.top, "Rows of the ranked table (--auto)")->capture_default_str();
  app.add_option("--families", o.families,
                 "Comma list of schedules to search (--auto; default all)");
  app.add_option("--remat", o.remat,
                 "Comma list of remat modes keep,min,full (--auto; default all)");
  app.add_option("--interleaved-v", o.interleaved_v,
                 "Comma list of interleaved virtual stages (--auto; default 2)");
  app.add_option("--max-microbatches", o.max_microbatches,
                 "Largest microbatch count tried when --microbatches is not given (--auto; "
                 "default 4*ranks)");
  app.add_option("--gap", o.gap,
                 "Relative optimality gap (--auto): 0 is exact, 0.01 returns a plan within 1%")
      ->capture_default_str();
  app.add_flag("--update-in-place", o.update_in_place,
               "The step donates its parameters and optimizer state (--auto): the update after "
               "the loop writes the new ones in place instead of beside the old ones");
  app.add_option("--offload", o.offload,
                 "yes|no: plans over the memory budget may offload stashes to host memory (--auto: "
                 "needs the costs' host_link_bandwidth, default no; --profile: default when the "
                 "hardware has a host_link)");
  app.add_option("--host-memory", o.host_memory,
                 "Host bytes per rank offloaded stashes may hold, e.g. 200GiB (--auto; 0: unlimited)");
  app.add_option("--json", o.json, "Write the ranked plans and search statistics as JSON (--auto)");
  app.add_option("-v,--virtual-stages", o.virtual_stages, "Stages per rank (interleaved only)")
      ->capture_default_str();
  app.add_option("--costs", o.costs, "Cost model JSON file");
  app.add_option("--svg", o.svg, "Write an SVG timeline of the simulated step");
  app.add_option("--trace", o.trace, "Write a Chrome/Perfetto trace of the simulated step");
  app.add_option("--time-unit-us", o.time_unit_us, "Microseconds per cost unit in the trace")
      ->capture_default_str();
  app.add_flag("--grid", o.grid, "Print a text timeline of the simulated step");
  app.add_option("--grid-width", o.grid_width, "Columns of the text timeline (0: automatic)");
  app.add_flag("--print-plan", o.print_plan, "Print every rank's instruction stream");
  app.add_flag("--print-rank-ir", o.print_rank_ir,
               "Print every rank's program (docs/RANK_IR.md)");
  auto* save = app.add_option("--save", o.save, "Write the schedule in the text format");
  auto* load = app.add_option("--load", o.load, "Read the schedule from a text-format file");
  app.add_option("--profile", o.profile,
                 "Model profile JSON: plan a training run at cluster scale (docs/SCALE.md)");
  app.add_option("--cluster", o.cluster, "Hardware JSON file (--profile)");
  app.add_option("--gpus", o.gpus, "GPU count (--profile)");
  app.add_option("--global-batch", o.global_batch, "Sequences per step (--profile)");
  app.add_flag("--fp8", o.fp8,
               "Linear layers in fp8 at the hardware file's fp8 GEMM rates, casts counted "
               "(--profile, --model)");
  // Never parsed here (main() hands a --model command line to baton-plan-model); listed so
  // that --help shows it.
  std::string model_help;
  app.add_option("--model", model_help,
                 "Model name (llama3-8b/70b/405b, gpt3-175b, deepseek-v3, mixtral-8x7b, ... ) "
                 "or a 'gpt:layers=..,hidden=..,heads=..' / 'llama:...' spec: trace it "
                 "abstractly and plan at cluster scale with --cluster (a100, h100, h100-500w, "
                 "h200, h800, b200 or a JSON file), --gpus, --global-batch; also --seq, --fp8, "
                 "--pp/--tp/--ep lists, --fsdp yes|no, --tp-overlap yes|no, --dp-overlap "
                 "yes|no (default: both searched), --grad-reduce-bytes, --families, --top, "
                 "--json, --profile-out (runs the baton-plan-model script; docs/SCALE.md)");
  app.add_option("--pp", o.pp, "Comma list of pipeline degrees to try (--profile)");
  app.add_option("--tp", o.tp, "Comma list of tensor degrees to try (--profile)");
  app.add_option("--fsdp", o.fsdp, "yes: FSDP only, no: ZeRO-1 only (--profile; default both)");
  bool list = false;
  app.add_flag("--list-schedules", list, "Print the schedule names and exit");
  load->excludes(sched);
  load->excludes(save);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "baton-plan: error: " << e.what() << "\n";
    return kExitInput;
  }

  try {
    if (list) {
      for (const auto& n : baton::schedule_names()) std::cout << n << "\n";
      return 0;
    }
    return run(o, ranks->count() > 0, mbs->count() > 0);
  } catch (const CliError& e) {
    std::cerr << "baton-plan: error: " << e.message << "\n";
    return e.code;
  } catch (const baton::VerifyError& e) {
    std::cerr << "baton-plan: error: " << first_line(e.what()) << "\n";
    return kExitVerify;
  } catch (const baton::Error& e) {
    std::cerr << "baton-plan: error: " << first_line(e.what()) << "\n";
    return kExitInput;
  } catch (const std::exception& e) {
    std::cerr << "baton-plan: error: " << e.what() << "\n";
    return kExitInput;
  }
}
