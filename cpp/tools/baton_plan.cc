// baton-plan: build (or load) a pipeline schedule, lower it, verify it,
// simulate it and print the summary table; optionally write pictures.
//
//   baton-plan --schedule zbv --ranks 4 --microbatches 8 [--virtual-stages 2]
//              [--costs costs.json] [--svg t.svg] [--trace t.json] [--grid]
//              [--print-plan] [--save s.txt | --load s.txt]
//
// Exit status: 0 success, 1 bad input (unknown schedule, generator refusal,
// unreadable file, parse error), 2 the plan failed verification.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>

#include "baton/cost.h"
#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
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
  int microbatches = 0;
  int virtual_stages = 1;
  std::string costs;
  std::string svg;
  std::string trace;
  bool grid = false;
  int grid_width = 0;
  bool print_plan = false;
  std::string save;
  std::string load;
  double time_unit_us = 1000.0;
};

int run(const Options& o, bool have_ranks, bool have_microbatches) {
  baton::Schedule schedule;
  if (!o.load.empty()) {
    schedule = baton::load_schedule(read_file(o.load, "schedule file"));
    if (have_ranks && o.ranks != schedule.num_ranks) {
      throw CliError{fmt::format("schedule file '{}' is for {} ranks, but --ranks {} was given",
                                 o.load, schedule.num_ranks, o.ranks)};
    }
    if (have_microbatches && o.microbatches != schedule.num_microbatches) {
      throw CliError{
          fmt::format("schedule file '{}' is for {} microbatches, but --microbatches {} was given",
                      o.load, schedule.num_microbatches, o.microbatches)};
    }
  } else {
    if (o.schedule.empty()) throw CliError{"--schedule or --load is required"};
    if (!have_ranks) throw CliError{"--ranks is required with --schedule"};
    if (!have_microbatches) throw CliError{"--microbatches is required with --schedule"};
    schedule = baton::make_schedule(o.schedule, o.ranks, o.microbatches, o.virtual_stages);
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

  const baton::SimResult result = baton::simulate(plan, costs);
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
  CLI::App app{"Build, lower, verify and simulate a pipeline schedule.", "baton-plan"};
  Options o;
  auto* sched = app.add_option("-s,--schedule", o.schedule,
                               "Schedule generator: gpipe 1f1b eager1f1b interleaved zbh1 zbh2 "
                               "zbv dualpipev");
  auto* ranks = app.add_option("-p,--ranks", o.ranks, "Pipeline ranks");
  auto* mbs = app.add_option("-m,--microbatches", o.microbatches, "Microbatches per step");
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
  auto* save = app.add_option("--save", o.save, "Write the schedule in the text format");
  auto* load = app.add_option("--load", o.load, "Read the schedule from a text-format file");
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
