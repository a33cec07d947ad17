# Smoke test of the baton-plan command (run by ctest: cmake -DCLI=<exe> -P cli_smoke.cmake).
if(NOT CLI)
  message(FATAL_ERROR "pass -DCLI=<path to baton-plan>")
endif()

function(expect_match what text regex)
  if(NOT text MATCHES "${regex}")
    message(FATAL_ERROR "${what}: expected output matching '${regex}', got:\n${text}")
  endif()
endfunction()

# 1. A good run prints the summary table.
execute_process(COMMAND "${CLI}" --schedule zbv --ranks 4 --microbatches 8 --grid
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "good run exited ${rc}:\n${out}\n${err}")
endif()
expect_match("good run" "${out}" "[Bb]ubble")

# 1b. The rank programs in their text form.
execute_process(COMMAND "${CLI}" -s 1f1b -p 2 -m 2 --print-rank-ir
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--print-rank-ir exited ${rc}:\n${out}\n${err}")
endif()
expect_match("--print-rank-ir" "${out}" "rank-ir 1f1b: ranks 2.*#0 RUN F0.0 reads - writes")

# 2. Save the schedule and load it back: same summary.
set(_file "${CMAKE_CURRENT_BINARY_DIR}/cli_smoke_schedule.txt")
execute_process(COMMAND "${CLI}" -s 1f1b -p 2 -m 4 --save "${_file}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out1 ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "save run exited ${rc}:\n${err}")
endif()
execute_process(COMMAND "${CLI}" --load "${_file}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out2 ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "load run exited ${rc}:\n${err}")
endif()
if(NOT out1 STREQUAL out2)
  message(FATAL_ERROR "saved and loaded schedules differ:\n${out1}\n---\n${out2}")
endif()

# 3. Bad input exits non-zero with one "baton-plan: error:" line on stderr.
execute_process(COMMAND "${CLI}" --schedule no-such-schedule --ranks 4 --microbatches 8
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "unknown schedule was accepted:\n${out}")
endif()
expect_match("unknown schedule" "${err}" "^baton-plan: error: [^\n]+\n$")

# 4. A parse error names line and column.
file(WRITE "${_file}" "baton-schedule 1\nranks two\n")
execute_process(COMMAND "${CLI}" --load "${_file}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "malformed schedule file was accepted:\n${out}")
endif()
expect_match("parse error" "${err}" "baton-plan: error: .*line 2")
file(REMOVE "${_file}")

# 5. --auto plans from segment costs: ranked table; nothing fits exits 1 naming the peak.
set(_seg "${CMAKE_CURRENT_BINARY_DIR}/cli_smoke_segments.json")
file(WRITE "${_seg}" [=[
{"batch": 8, "ref_microbatch": 1, "link": {"latency": 0.01, "bandwidth": 0},
 "host_link_bandwidth": 100,
 "segments": [
  {"name": "emb", "f": 2, "b": 3, "i": 2, "w": 1, "act_bytes": 10, "stash_bytes": 40,
   "min_stash_bytes": 10, "min_recompute": 0.5, "param_bytes": 1000, "opt_bytes": 2000},
  {"f": 1, "b": 2, "i": 1, "w": 1, "act_bytes": 10, "stash_bytes": 40, "param_bytes": 100},
  {"f": 1, "b": 2, "i": 1, "w": 1, "act_bytes": 10, "stash_bytes": 40, "param_bytes": 100},
  {"f": 1, "b": 2, "i": 1, "w": 1, "act_bytes": 10, "stash_bytes": 40, "param_bytes": 100},
  {"name": "head", "f": 3, "b": 5, "i": 3, "w": 2, "act_bytes": 10, "stash_bytes": 40,
   "param_bytes": 1500, "opt_bytes": 3000}
 ]}
]=])
execute_process(COMMAND "${CLI}" --auto --segments "${_seg}" --ranks 2 --memory 1MiB --top 3
                        --microbatches 2,4,8
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--auto run exited ${rc}:\n${out}\n${err}")
endif()
expect_match("--auto table" "${out}" "step_time")
expect_match("--auto table" "${out}" "\n  1  [a-z0-9]+ ")
expect_match("--auto stats" "${out}" "simulated.*exact")
execute_process(COMMAND "${CLI}" --auto --segments "${_seg}" --ranks 2 --memory 1KiB
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "--auto with nothing fitting exited ${rc} (expected 1):\n${out}\n${err}")
endif()
expect_match("--auto nothing fits" "${err}"
             "^baton-plan: error: autoplan: no candidate fits .* on rank [0-9]")
execute_process(COMMAND "${CLI}" --auto --segments "${_seg}" --ranks 2 --memory 1MiB --top 3
                        --microbatches 2,4,8 --offload yes --host-memory 1GiB
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--auto --offload yes exited ${rc}:\n${out}\n${err}")
endif()
expect_match("--auto --offload stats" "${out}" "simulated \\([0-9]+ with offloads\\)")
execute_process(COMMAND "${CLI}" --auto --segments "${_seg}" --ranks 2 --offload maybe
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "--offload maybe exited ${rc} (expected 1):\n${err}")
endif()
expect_match("--offload maybe" "${err}" "--offload must be yes or no")
execute_process(COMMAND "${CLI}" --auto --segments "${_seg}" --ranks 2 --memory lots
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "--auto with a bad --memory exited ${rc} (expected 1):\n${err}")
endif()
file(REMOVE "${_seg}")

# Cluster scale: a small model profile on the shipped H100 preset prints the ranked table;
# a missing --cluster is one error line.
get_filename_component(_root "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
set(_prof "${CMAKE_CURRENT_BINARY_DIR}/cli_smoke_profile.json")
file(WRITE "${_prof}" [=[{"name": "mlp", "seq": 128, "model_flops_per_sample": 1.2e10,
  "segments": [{"name": "layer", "repeat": 8, "fwd_flops": 5e8, "bwd_flops": 1e9,
  "wgrad_flops": 5e8, "params": 2097152, "act_bytes": 65536, "stash_keep": 327680,
  "stash_min": 327680, "stash_full": 65536, "tp_collectives": 1, "tp_bytes": 65536}]}]=])
execute_process(COMMAND "${CLI}" --profile "${_prof}" --cluster
                        "${_root}/python/baton/scale/clusters/h100.json" --gpus 16
                        --global-batch 64 --top 3
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--profile run exited ${rc}:\n${out}\n${err}")
endif()
expect_match("--profile run" "${out}" "tokens/s")
execute_process(COMMAND "${CLI}" --profile "${_prof}" --gpus 16 --global-batch 64
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "--profile without --cluster exited ${rc}")
endif()
expect_match("--profile without --cluster" "${err}" "baton-plan: error: --cluster is required")
