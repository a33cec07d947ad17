# Convenience targets; each one delegates to a script or a benchmark.
PY ?= .venv/bin/python

.PHONY: setup test test-cpp test-py demo bench bench-pipeline bench-pinned bench-pinned-ab bench-one-rank bench-stage-costs bench-plan

setup:
	bash scripts/setup.sh

test: setup
	bash scripts/test.sh

test-cpp: setup
	bash scripts/test.sh --cpp-only

test-py: setup
	bash scripts/test.sh --py-only

demo: setup
	bash scripts/demo.sh

# Pipeline benchmarks: tables in bench/results/ (they never fail on timing).
bench: bench-pipeline bench-pinned bench-pinned-ab bench-one-rank bench-stage-costs

bench-pipeline: setup
	$(PY) bench/pipeline.py --md bench/results/pipeline.md

bench-pinned: setup
	$(PY) bench/pinned.py --steps 8 --repeat 3 --md bench/results/pinned.md
	$(PY) bench/pinned.py --schedules 1f1b --one-rank "" --dim 512 --steps 6 --repeat 5 \
		--md bench/results/pinned.md

bench-pinned-ab: setup
	$(PY) bench/pinned_ab.py --schedules 1f1b,interleaved --rounds 8 --md bench/results/pinned.md
	$(PY) bench/pinned_ab.py --dim 512 --schedules 1f1b --rounds 6 \
		--md bench/results/pinned.md

bench-stage-costs: setup
	$(PY) bench/stage_costs.py --rounds 3 --md bench/results/stage_costs.md

bench-one-rank: setup
	$(PY) bench/one_rank.py --md bench/results/one_rank.md

bench-plan:
	cmake -S . -B build/rel -DCMAKE_BUILD_TYPE=Release -DBATON_BUILD_BENCH=ON -DBATON_BUILD_TESTS=OFF
	cmake --build build/rel -j2 --target bench_plan
	build/rel/bench_plan
