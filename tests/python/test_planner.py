"""Tests of the planner API: schedule specs, plans, verification, simulation, pictures, CLI."""

import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import baton
from baton import _core

ALL_SPECS = [
    baton.GPipe(),
    baton.OneFOneB(),
    baton.Eager1F1B(),
    baton.Interleaved1F1B(virtual_stages=2),
    baton.ZBH1(),
    baton.ZBH2(),
    baton.ZBV(),
    baton.DualPipeV(),
]
SIZES = [(2, 4), (4, 8), (4, 12)]

# A structurally valid schedule that deadlocks: rank 0 sends microbatch 0 first,
# rank 1 waits for microbatch 1 first.
DEADLOCK = """\
baton-schedule 1
name custom
ranks 2
stages 2
microbatches 2
placement 0 1
rank 0: F0.0 F0.1 B0.0 B0.1
rank 1: F1.1 B1.1 F1.0 B1.0
"""


def n_actions(schedule):
    return sum(len(schedule.actions(r)) for r in range(schedule.num_ranks))


# --- schedule specs -------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS, ids=repr)
@pytest.mark.parametrize("ranks,microbatches", SIZES)
def test_spec_builds_and_verifies(spec, ranks, microbatches):
    s = spec.build(ranks, microbatches)
    assert isinstance(s, baton.Schedule)
    assert s.num_ranks == ranks
    assert s.num_microbatches == microbatches
    assert s.num_stages == spec.stages(ranks)
    assert len(s.stage_rank) == s.num_stages
    s.validate()
    # one F and one B (or I and W) per (stage, microbatch), on the rank owning the stage
    kinds = {}
    for r, acts in enumerate(s.rank_actions):
        for a in acts:
            for t in a.tasks:
                assert s.stage_rank[t.stage] == r
                kinds.setdefault((t.stage, t.microbatch), []).append(str(t)[0])
    assert len(kinds) == s.num_stages * microbatches
    assert all(sorted(k) in (["B", "F"], ["F", "I", "W"]) for k in kinds.values())
    assert s.split_backward() == any("I" in k for k in kinds.values())
    p = baton.plan(spec, ranks, microbatches)
    report = p.verify()
    assert report.ok and bool(report) and report.violations == []
    assert p.fingerprint == baton.plan(spec, ranks, microbatches).fingerprint


def _refusal(name, ranks, microbatches, virtual_stages):
    """The message of the generator rule that refuses these sizes, or None when none does
    (the sizes the test draws are far below the generators' size limit)."""
    if name == "interleaved" and virtual_stages > 1 and microbatches > ranks \
            and microbatches % ranks:
        return ("interleaved needs microbatches to be a multiple of ranks, or at most ranks "
                f"(got ranks={ranks}, microbatches={microbatches}, v={virtual_stages})")
    if name == "dualpipev" and microbatches < 2 * ranks:
        return ("dualpipev needs microbatches >= 2*ranks "
                f"(got ranks={ranks}, microbatches={microbatches})")
    return None


@given(
    name=st.sampled_from(sorted(_core.schedule_names())),
    ranks=st.integers(1, 6),
    microbatches=st.integers(1, 16),
    virtual_stages=st.integers(1, 3),
)
@example(name="dualpipev", ranks=3, microbatches=5, virtual_stages=1)  # refused
@example(name="interleaved", ranks=4, microbatches=6, virtual_stages=2)  # refused
@example(name="interleaved", ranks=4, microbatches=3, virtual_stages=2)  # at most ranks: runs
def test_any_size_is_refused_or_verifies(name, ranks, microbatches, virtual_stages):
    v = virtual_stages if name == "interleaved" else None
    spec = baton.schedule_from_name(name, virtual_stages=v)
    refusal = _refusal(name, ranks, microbatches, virtual_stages)
    if refusal is not None:  # exactly the sizes a generator's rule refuses, with that rule
        with pytest.raises(baton.ScheduleError) as info:
            baton.plan(spec, ranks, microbatches)
        assert refusal in str(info.value), (refusal, str(info.value))
        return
    p = baton.plan(spec, ranks, microbatches)
    assert p.verify().ok
    assert p.num_stages == spec.stages(ranks)
    again = baton.plan(baton.ScheduleFile(p.save()))
    assert again.fingerprint == p.fingerprint
    r = p.simulate()
    assert len(r.runs) == n_actions(p.schedule)
    assert 0.0 <= r.bubble_fraction < 1.0


def test_spec_stage_counts():
    assert baton.GPipe().stages(4) == 4
    assert baton.OneFOneB().stages(3) == 3
    assert baton.Interleaved1F1B(virtual_stages=3).stages(4) == 12
    assert baton.ZBV().stages(4) == 8
    assert baton.DualPipeV().stages(2) == 4
    assert baton.ZBH1().stages(5) == 5


def test_spec_repr_equality_hash():
    assert repr(baton.ZBV()) == "ZBV()"
    assert repr(baton.Interleaved1F1B(virtual_stages=2)) == "Interleaved1F1B(virtual_stages=2)"
    assert baton.Interleaved1F1B(3) == baton.Interleaved1F1B(virtual_stages=3)
    assert baton.Interleaved1F1B(3) != baton.Interleaved1F1B(2)
    assert baton.ZBH1() == baton.ZBH1() and baton.ZBH1() != baton.ZBH2()
    assert len({baton.ZBV(), baton.ZBV(), baton.GPipe(), baton.Interleaved1F1B(2)}) == 3
    assert baton.ScheduleFile("a.txt") == baton.ScheduleFile("a.txt")
    assert repr(baton.ScheduleFile("a.txt")) == "ScheduleFile('a.txt')"


def test_schedule_from_name():
    assert baton.schedule_from_name("zbv") == baton.ZBV()
    assert baton.schedule_from_name("ZB-V", virtual_stages=1) == baton.ZBV()
    assert baton.schedule_from_name("1F1B") == baton.OneFOneB()
    assert baton.schedule_from_name("dual_pipe_v") == baton.DualPipeV()
    assert baton.schedule_from_name("interleaved", virtual_stages=3) == baton.Interleaved1F1B(3)
    assert baton.schedule_from_name("interleaved") == baton.Interleaved1F1B(2)
    with pytest.raises(baton.ScheduleError, match="virtual_stages=2"):
        baton.schedule_from_name("zbh1", virtual_stages=2)
    with pytest.raises(baton.ScheduleError, match="'nope'.*gpipe"):
        baton.schedule_from_name("nope")
    assert sorted(baton.schedule_names()) == sorted(_core.schedule_names())


def test_bad_sizes_are_config_errors():
    with pytest.raises(baton.ConfigError, match=r"ranks must be a positive integer \(got 0\)"):
        baton.ZBV().build(0, 8)
    with pytest.raises(baton.ConfigError, match="microbatches"):
        baton.GPipe().build(2, "8")
    with pytest.raises(baton.ConfigError, match="virtual_stages"):
        baton.Interleaved1F1B(virtual_stages=0)


# --- errors from the C++ core ---------------------------------------------------------


def test_schedule_error_classes_and_message():
    assert issubclass(baton.ScheduleError, ValueError)
    assert issubclass(baton.ScheduleError, baton.BatonError)
    with pytest.raises(baton.ScheduleError) as exc:
        _core.make_schedule("zbv", 4, 8, 3)  # only "interleaved" takes virtual stages
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, baton.BatonError)
    assert "3" in str(exc.value)
    with pytest.raises(baton.ScheduleError, match="no-such"):
        _core.make_schedule("no-such", 2, 4)


def test_generator_refusal_names_values():
    with pytest.raises(baton.ScheduleError, match=r"microbatches.*got microbatches=0"):
        _core.make_schedule("1f1b", 3, 0)
    # DualPipeV needs at least 2 microbatches per rank; the spec path raises the same error.
    with pytest.raises(baton.ScheduleError, match=r"ranks=3, microbatches=4") as exc:
        baton.plan(baton.DualPipeV(), ranks=3, microbatches=4)
    assert isinstance(exc.value, ValueError)


def test_malformed_schedule_object_is_schedule_error():
    s = baton.OneFOneB().build(2, 2)
    s.stage_rank = [0, 5]
    with pytest.raises(baton.ScheduleError):
        s.validate()
    with pytest.raises(baton.ScheduleError):
        baton.plan(s)


def test_config_error_from_cost_model():
    costs = baton.CostModel()
    costs.default_stage.f = -1.0
    assert costs.default_stage.f == -1.0
    with pytest.raises(baton.ConfigError) as exc:
        costs.validate()
    assert isinstance(exc.value, ValueError)


# --- text format ----------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS, ids=repr)
def test_save_load_round_trip_keeps_fingerprint(spec, tmp_path):
    p = baton.plan(spec, 4, 8)
    path = tmp_path / "schedule.txt"
    text = p.save(path)
    assert path.read_text() == text
    assert baton.load_schedule(path) == p.schedule
    assert baton.load_schedule(text) == p.schedule
    from_file = baton.plan(baton.ScheduleFile(path))
    assert from_file.fingerprint == p.fingerprint
    assert from_file == p
    assert baton.plan(baton.ScheduleFile(str(path)), 4, 8).fingerprint == p.fingerprint
    assert baton.ScheduleFile(text).stages() == spec.stages(4)


def test_schedule_file_size_mismatch(tmp_path):
    path = tmp_path / "s.txt"
    baton.plan(baton.OneFOneB(), 2, 4).save(path)
    with pytest.raises(baton.ScheduleError, match="ranks=2.*ranks=3"):
        baton.plan(baton.ScheduleFile(path), ranks=3)
    with pytest.raises(baton.ConfigError, match="cannot read schedule file"):
        baton.load_schedule(str(tmp_path / "missing.txt"))


def test_format_error_line_and_column():
    text = DEADLOCK.replace("rank 1: F1.1", "rank 1: Q1.1")
    with pytest.raises(baton.FormatError) as exc:
        baton.load_schedule(text)
    e = exc.value
    assert isinstance(e, ValueError) and isinstance(e, baton.BatonError)
    assert e.line == 8
    assert e.column == 9
    assert "line 8" in str(e)


# --- plans and verification -----------------------------------------------------------


def test_plan_accepts_spec_name_and_schedule():
    s = baton.ZBH1().build(2, 4)
    a = baton.plan(s)
    b = baton.plan("zbh1", ranks=2, microbatches=4)
    c = baton.plan(baton.ZBH1(), 2, 4)
    assert a.fingerprint == b.fingerprint == c.fingerprint
    assert a.num_ranks == 2 and a.num_stages == 2 and a.num_microbatches == 4
    assert "zbh1" in repr(a)
    with pytest.raises(baton.ConfigError, match="needs ranks and microbatches"):
        baton.plan(baton.ZBH1())
    with pytest.raises(baton.ConfigError, match="needs microbatches"):
        baton.plan(baton.ZBH1(), ranks=2)
    with pytest.raises(baton.ConfigError, match="ranks=2, but ranks=3"):
        baton.plan(s, ranks=3)
    with pytest.raises(baton.ConfigError):
        baton.plan(42)


def test_plan_programs_and_buffers():
    p = baton.plan(baton.OneFOneB(), 2, 3)
    s = p.schedule
    assert s.actions(0) == ["F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "B0.2"]
    assert s.actions(1) == ["F1.0", "B1.0", "F1.1", "B1.1", "F1.2", "B1.2"]
    assert len(p.programs) == 2
    for r in range(2):
        prog = p.program(r)
        assert len(prog) == len(p.programs[r])
        assert {op for op, *_ in prog} <= {"RUN", "SEND", "RECV", "FREE", "ACCUMULATE"}
        runs = [t for t in prog if t[0] == "RUN"]
        assert [t[1] for t in runs] == list(range(len(s.actions(r))))
        assert prog[0] == p.programs[r][0].astuple()
        assert p.describe(r, 0).startswith(f"rank {r} #0")
    # F1.0 reads the activation of stage 0, microbatch 0
    act = p.buffer_id(baton.BufKind.Act, 0, 0)
    f10 = baton.Task(baton.TaskKind.F, 1, 0)
    assert act in p.task_inputs(f10)
    assert p.buffer_key(act) == baton.BufferKey(baton.BufKind.Act, 0, 0)
    assert p.describe_buffer(act) == "act(s0,m0)"
    assert p.buffer_id(baton.BufKind.Stash, 1, 0) in p.task_outputs(f10)
    sends = [t for t in p.program(0) if t[0] == "SEND"]
    assert sends and all(t[3] == 1 for t in sends)
    assert "RUN" in p.to_text()
    with pytest.raises(IndexError):
        p.program(2)
    with pytest.raises(IndexError):
        s.actions(-1)


def test_fused_actions_are_strings():
    s = baton.DualPipeV().build(2, 8)
    fused = [a for r in range(2) for a in s.actions(r) if "+" in a]
    assert fused, "DualPipeV fuses F and B in its steady phase"
    assert all(a.count("+") == 1 for a in fused)


def test_verify_reports_deadlock(tmp_path):
    p = baton.plan(baton.ScheduleFile(DEADLOCK))
    with pytest.raises(baton.VerifyError) as exc:
        p.verify()
    assert isinstance(exc.value, RuntimeError)
    assert "deadlock" in str(exc.value)
    report = p.verify(raise_on_error=False)
    assert not report.ok and not bool(report)
    checks = {v.check for v in report.violations}
    assert "deadlock" in checks
    v = next(v for v in report.violations if v.check == "deadlock")
    assert v.ranks and len(v.ranks) == len(v.instrs)
    assert set(v.ranks) <= {0, 1}
    assert not p.check_deadlock().ok
    with pytest.raises(baton.VerifyError):
        _core.verify_or_throw(p.core)
    assert "verification: FAILED" in p.summary()  # the simulator's async model completes


# --- simulation and pictures ----------------------------------------------------------


def test_simulate_fields_1f1b():
    ranks, m = 2, 4
    p = baton.plan(baton.OneFOneB(), ranks, m)
    r = p.simulate()  # uniform default: F=1, B=2, no communication cost
    assert r.step_time == pytest.approx((m + ranks - 1) * 3.0)
    assert r.busy == pytest.approx([m * 3.0] * ranks)
    assert r.bubble == pytest.approx([1 - 12 / 15] * ranks)
    assert r.bubble_fraction == pytest.approx(1 - 24 / 30)
    assert len(r.runs) == n_actions(p.schedule)
    assert all(e.end > e.start >= 0 for e in r.runs)
    assert len(r.peak_activation) == ranks and len(r.peak_total) == ranks
    assert all(a >= 1 for a in r.peak_activation)
    assert all(t >= a for t, a in zip(r.peak_total, r.peak_activation))
    assert len(r.memory) == ranks and all(len(tl) > 0 for tl in r.memory)
    assert len(r.transfers) == 2 * m  # one activation and one gradient per microbatch
    assert all(t.src != t.dst and t.end >= t.start for t in r.transfers)
    assert r.critical_path and r.critical_path[-1].end == pytest.approx(r.step_time)
    assert r.span_start == pytest.approx([0.0, 1.0])
    assert r.span_end == pytest.approx([15.0, 13.0])


def test_simulate_cost_inputs(tmp_path):
    p = baton.plan(baton.OneFOneB(), 2, 4)
    doubled = {"default": {"f": 2.0, "b": 4.0}}
    assert p.simulate(doubled).step_time == pytest.approx(30.0)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(doubled))
    assert p.simulate(path).step_time == pytest.approx(30.0)
    assert p.simulate(str(path)).step_time == pytest.approx(30.0)
    assert p.simulate(json.dumps(doubled)).step_time == pytest.approx(30.0)
    model = baton.CostModel.uniform(2.0, 4.0, 2.0, 2.0)
    assert p.simulate(model).step_time == pytest.approx(30.0)
    assert baton.CostModel.from_json(model.to_json()).default_stage == model.default_stage
    per_stage = baton.CostModel()
    per_stage.stages = [baton.StageCost(f=2.0, b=4.0), baton.StageCost(f=2.0, b=4.0, i=2, w=2)]
    assert p.simulate(per_stage).step_time == pytest.approx(30.0)
    assert per_stage.stage(0) == baton.StageCost(f=2.0, b=4.0)
    assert per_stage.stage(7) == baton.StageCost()  # unlisted stages use the default
    assert baton.LinkCost(latency=0.5).latency == 0.5
    slow = baton.CostModel()
    slow.link.latency = 1.0
    assert p.simulate(slow).step_time > 15.0
    with pytest.raises(baton.FormatError, match="bogus"):
        p.simulate({"default": {"bogus": 1}})
    with pytest.raises(baton.FormatError):
        p.simulate("{not json")
    with pytest.raises(baton.ConfigError, match="cannot read cost file"):
        p.simulate(str(tmp_path / "missing.json"))
    with pytest.raises(baton.ConfigError):
        p.simulate(3.5)


@pytest.mark.parametrize(
    "spec", [baton.ZBV(), baton.DualPipeV(), baton.Interleaved1F1B(2)], ids=repr
)
def test_trace_has_one_x_event_per_action(spec, tmp_path):
    p = baton.plan(spec, 4, 8)
    path = tmp_path / "trace.json"
    text = p.to_trace(path=path)
    assert path.read_text() == text
    trace = json.loads(text)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    xs = [e for e in events if e.get("ph") == "X" and e.get("cat") != "transfer"]
    assert len(xs) == n_actions(p.schedule)
    assert {e["tid"] for e in xs} == set(range(4))
    assert sorted(e["name"] for e in xs) == sorted(
        a for r in range(4) for a in p.schedule.actions(r)
    )
    transfers = [e for e in events if e.get("ph") == "X" and e.get("cat") == "transfer"]
    assert len(transfers) == len(p.simulate().transfers)


def test_svg_parses(tmp_path):
    p = baton.plan(baton.ZBH1(), 4, 8)
    path = tmp_path / "t.svg"
    svg = p.to_svg(path=path)
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    assert len(list(root.iter("{http://www.w3.org/2000/svg}rect"))) + len(
        list(root.iter("rect"))
    ) >= n_actions(p.schedule)
    assert path.read_text() == svg


def test_grid_and_summary():
    p = baton.plan(baton.ZBV(), 4, 8)
    grid = p.to_grid(width=40)
    assert len([ln for ln in grid.splitlines() if ln.strip()]) >= 4
    summary = p.summary()
    assert "bubble" in summary.lower()
    assert "zbv" in summary.lower()


# --- the baton-plan command -----------------------------------------------------------


def run_cli(exe, *args):
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)


def test_cli_installed_and_runs(baton_plan_exe, tmp_path):
    venv_bin = os.path.dirname(baton_plan_exe)
    assert shutil.which("baton-plan", path=venv_bin) == str(baton_plan_exe)
    svg, trace = tmp_path / "t.svg", tmp_path / "t.json"
    r = run_cli(baton_plan_exe, "--schedule", "zbv", "--ranks", "4", "--microbatches", "8",
                "--grid", "--svg", str(svg), "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    assert "bubble" in r.stdout.lower()
    ET.parse(svg)
    events = json.loads(trace.read_text())["traceEvents"]
    n = sum(len(baton.ZBV().build(4, 8).actions(r)) for r in range(4))
    assert len([e for e in events if e["ph"] == "X" and e.get("cat") != "transfer"]) == n
    # the CLI's numbers are the library's
    assert baton.plan(baton.ZBV(), 4, 8).summary() in r.stdout


def test_cli_errors(baton_plan_exe, tmp_path):
    r = run_cli(baton_plan_exe, "--schedule", "nope", "--ranks", "2", "--microbatches", "2")
    assert r.returncode == 1
    assert r.stderr.startswith("baton-plan: error:") and r.stderr.count("\n") == 1
    r = run_cli(baton_plan_exe, "--load", str(tmp_path / "missing.txt"))
    assert r.returncode == 1 and "cannot read" in r.stderr
    bad = tmp_path / "bad.txt"
    bad.write_text(DEADLOCK.replace("rank 1: F1.1", "rank 1: Q1.1"))
    r = run_cli(baton_plan_exe, "--load", str(bad))
    assert r.returncode == 1 and "line 8" in r.stderr
    dead = tmp_path / "dead.txt"
    dead.write_text(DEADLOCK)
    r = run_cli(baton_plan_exe, "--load", str(dead))
    assert r.returncode == 2
    assert r.stderr.startswith("baton-plan: error: verification failed (4 violations)")
    assert "deadlock (blocking model)" in r.stdout  # the full report
    r = run_cli(baton_plan_exe, "--ranks", "2")
    assert r.returncode == 1 and "--schedule or --load" in r.stderr


# --- automatic planning over segment costs (autoplan.h) ---

def _segments(n=6, batch=8):
    segs = []
    for k in range(n):
        big = k in (0, n - 1)
        segs.append(
            dict(f=2.0 if big else 1.0, b=4.0 if big else 2.0, i=2.0 if big else 1.0,
                 w=2.0 if big else 1.0, act_bytes=10, stash_bytes=100, min_stash_bytes=20,
                 min_recompute=0.3, param_bytes=1000 if big else 100, opt_bytes=200)
        )
    return dict(batch=batch, ref_microbatch=1, link=dict(latency=0.01, bandwidth=0), segments=segs)


def test_parse_memory():
    from baton.planning.plan import parse_memory

    assert parse_memory("20GiB") == 20 * 2**30
    assert parse_memory("1.5GB") == 1_500_000_000
    assert parse_memory("512 MiB") == 512 * 2**20
    assert parse_memory("1e9") == 10**9
    assert parse_memory(None) == 0 and parse_memory(123) == 123
    for bad in ("lots", "3 parsecs", -1, True):
        with pytest.raises(baton.ConfigError):
            parse_memory(bad)


def _stage_costs(costs, cuts, remat):
    """The cost model of stages cut from segment costs without task or step overheads
    (autoplan.h's rules: sums; "min" adds each segment's min_recompute to B and I, "full"
    the stage's F; activations are the last segment's, gradients the previous stage's)."""
    segs = costs["segments"]
    bounds = list(cuts) + [len(segs)]
    stages = []
    for k, mode in enumerate(remat):
        part = segs[bounds[k]:bounds[k + 1]]
        total = {t: sum(g.get(t, 0.0) for g in part) for t in "fbiw"}
        extra = {"keep": 0.0, "full": total["f"],
                 "min": sum(g.get("min_recompute", 0.0) for g in part)}[mode]
        grad = segs[bounds[k] - 1]["act_bytes"] if k else 0
        stash = {"keep": sum(g.get("stash_bytes", 0) for g in part), "full": grad,
                 "min": sum(g.get("min_stash_bytes", 0) for g in part)}[mode]
        stages.append(dict(f=total["f"], b=total["b"] + extra, i=total["i"] + extra,
                           w=total["w"], fb=0.0, act_bytes=part[-1]["act_bytes"],
                           grad_bytes=grad, stash_bytes=stash,
                           wstash_bytes=sum(g.get("wstash_bytes", 0) for g in part),
                           wgrad_bytes=sum(g.get("param_bytes", 0) for g in part)))
    return {"stages": stages, "link": costs["link"]}


def test_autoplan_segments_rows_and_stats(tmp_path):
    from baton.planning.plan import autoplan_segments

    costs = _segments()
    rows = autoplan_segments(costs, ranks=2, memory_per_device="1MiB", top=3,
                             microbatches=[2, 4, 8])
    assert 1 <= len(rows) <= 3
    assert rows.stats["exact"] and rows.stats["simulated"] > 0
    steps = [r["step_time"] for r in rows]
    assert steps == sorted(steps)
    best = rows[0]
    assert best["fits"] and len(best["peak_memory"]) == 2
    assert best["cuts"][0] == 0 and len(best["cuts"]) == len(best["remat"])
    assert len(best["cuts"]) == 2 * best["virtual_stages"]
    # The row is what the simulator says about that plan: its stage costs derived here from
    # the segments (sums over each stage's cut, remat's recompute on B and I), simulated.
    p = baton.plan(best["schedule"] if best["schedule"] != "interleaved"
                   else baton.Interleaved1F1B(virtual_stages=best["virtual_stages"]),
                   2, best["microbatches"])
    assert p.verify().ok
    sim = p.simulate(_stage_costs(costs, best["cuts"], best["remat"]))
    assert best["step_time"] == pytest.approx(sim.step_time, rel=1e-9)
    assert best["bubble_fraction"] == pytest.approx(sim.bubble_fraction, rel=1e-9)
    for row in rows:  # every row, not only the best
        q = baton.plan(row["schedule"] if row["schedule"] != "interleaved"
                       else baton.Interleaved1F1B(virtual_stages=row["virtual_stages"]),
                       2, row["microbatches"])
        want = q.simulate(_stage_costs(costs, row["cuts"], row["remat"])).step_time
        assert row["step_time"] == pytest.approx(want, rel=1e-9), row
    # Same answer from a JSON file path, and the table renders.
    path = tmp_path / "segments.json"
    path.write_text(json.dumps(costs))
    again = autoplan_segments(str(path), 2, 2**20, top=3, microbatches=[2, 4, 8])
    assert [r["step_time"] for r in again] == steps
    assert best["schedule"] in rows.table()


def test_autoplan_segments_errors():
    from baton.planning.plan import autoplan_segments

    with pytest.raises(baton.ConfigError, match="no candidate fits.*on rank"):
        autoplan_segments(_segments(), ranks=2, memory_per_device="1KiB")
    bad = _segments()
    bad["segments"][2]["f"] = "x"
    with pytest.raises(baton.FormatError, match=r"segments\[2\]\.f"):
        autoplan_segments(bad, ranks=2)
    with pytest.raises(baton.ConfigError, match="microbatches 3"):
        autoplan_segments(_segments(), ranks=2, microbatches=[3])
