"""Chaos runs: multi-process training (bench/chaos_worker.py over Gloo, checkpoints every 3
steps) in which one random process is SIGKILLed or frozen (SIGSTOP) at a random moment:
while it compiles, inside the training loop, during a checkpoint save, during a restore.

    python bench/chaos.py --runs 50 [--seed 0] [--out bench/results/chaos.md]

Per world size (2, 3, 4 processes) one reference run that never stops gives the losses of
every step (as float.hex), the digest of the final state and the duration of each phase
(from the workers' ``CHAOS`` markers). Then each chaos run:

1. starts the processes (directly, one per rank, ``BATON_*`` variables and a fresh file
   store: no launcher that would terminate the survivors for them), with the transfer and
   connect timeout ``--timeout`` (10 s); a restore run starts from a copy of the
   reference's checkpoints, cut after a random committed step;
2. waits for the victim's marker of the chosen phase, sleeps a random fraction (0 to 0.5)
   of that phase's reference duration, and sends the signal (or, for half of the save faults, the
   victim signals itself at a random point of ``baton.checkpoint.commit._test_hook``:
   ``writing``, ``written``, ``commit``); the phase the victim was in when it was hit is
   read from its last marker;
3. checks that every other process exits within ``--limit`` (60 s) of the fault, with code
   3 and an error that names the victim's rank; a process still running ``--hard`` (90 s)
   after the fault is killed and counted as a hang; a frozen victim is then thawed
   (SIGCONT) and must exit within the limit too;
4. resumes from the newest committed checkpoint (a fresh start, no fault) and checks that
   the step it restored is at least the newest save any process saw committed, that every
   loss after it equals the reference's bit for bit, and that the final state's digest
   equals the reference's.

Writes ``--out`` (a Markdown summary and one row per run) and ``<out>.json`` (raw records).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import signal
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from chaos_procs import (EVERY, STEPS, clean_run, committed_steps, done_digest,  # noqa: E402
                         losses_of, phase_times, start, worker_args)
SAVES = list(range(EVERY, STEPS, EVERY))  # 3, 6, 9


@dataclasses.dataclass
class Reference:
    world: int
    losses: dict
    digest: str
    phases: dict  # phase -> seconds (compile, save, step, restore)
    ckpt: str  # its checkpoint directory (steps 3, 6, 9 committed)


def reference(world, root, timeout, measure_restore=True) -> Reference:
    """The run that never stops (its losses, digest, phase durations and checkpoints); with
    ``measure_restore`` also a clean resume from its first checkpoint (checked against it),
    which times the restore phase."""
    ck = os.path.join(root, f"ref{world}")
    procs = clean_run(world, ck, timeout)
    losses = losses_of(procs[0])
    digests = {done_digest(p) for p in procs}
    for p in procs[1:]:
        assert losses_of(p) == losses, f"reference: ranks disagree on the losses ({world})"
    assert len(digests) == 1 and None not in digests, digests
    phases = phase_times(procs[0])
    if not measure_restore:
        return Reference(world, losses, digests.pop(), phases, ck)
    # a clean resume from a cut copy: measures the restore phase and checks resuming itself
    cut = os.path.join(root, f"ref{world}-resume")
    copy_cut(ck, cut, SAVES[0])
    rp = clean_run(world, cut, timeout, resume=True)
    got = losses_of(rp[0])
    want = {i: v for i, v in losses.items() if i > SAVES[0]}
    assert got == want, f"reference resume from step {SAVES[0]} differs: {got} vs {want}"
    assert done_digest(rp[0]) == digests.pop()
    phases["restore"] = phase_times(rp[0]).get("restore", 0.5)
    shutil.rmtree(cut, ignore_errors=True)
    return Reference(world, losses, done_digest(procs[0]), phases, ck)


def copy_cut(src, dst, last):
    """``src``'s checkpoint directory with the steps after ``last`` removed."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for d in os.listdir(dst):
        if d.isdigit() and int(d) > last:
            shutil.rmtree(os.path.join(dst, d))


@dataclasses.dataclass
class Spec:
    index: int
    world: int
    moment: str  # compile | loop | save | restore
    sig: str  # KILL | STOP
    victim: int
    delay_frac: float
    hook: str = ""  # save via the checkpoint hook: "<event>:<step>:<sig>"
    at_step: int = 0  # loop: after this step's marker; save: this save; restore: cut step


def plan_runs(n, rng) -> list[Spec]:
    moments = ["compile", "loop", "save", "restore"]
    specs = []
    for i in range(n):
        world = rng.choices([2, 3, 4], weights=[6, 2, 2])[0]
        moment = moments[i % 4]
        sig = "KILL" if (i // 4) % 2 == 0 else "STOP"
        victim = rng.randrange(world)
        s = Spec(i, world, moment, sig, victim, rng.random())
        if moment == "loop":
            # after step 1, 2, 5 or 8: the next step runs with no save in flight
            s.at_step = rng.choice([1, 2, 5, 8])
        elif moment == "save":
            s.at_step = rng.choice(SAVES)
            if rng.random() < 0.5:
                event = rng.choice(["writing", "written", "commit"])
                if event == "commit":
                    s.victim = 0  # only process 0 commits
                s.hook = f"{event}:{s.at_step}:{sig}"
        elif moment == "restore":
            s.at_step = rng.choice(SAVES)
        specs.append(s)
    return specs


def phase_at(proc, t):
    """The phase ``proc`` was in at time ``t`` (from its markers up to then)."""
    phase = "start"
    saving = False
    for tm, m in proc.markers():
        if tm > t:
            break
        kind = m.split()[0]
        if kind == "save-begin":
            saving = True
        elif kind == "save-end":
            saving = False
        if kind in ("compile-begin", "restore-begin"):
            phase = kind[:-6]
        elif kind in ("compile-end", "restore-end", "start", "step"):
            phase = "loop"
        elif kind == "hook":
            return f"save ({m.split()[1]})"
        elif kind == "done":
            return "after the end"  # the victim had finished training: not a fault run
    if phase == "loop" and saving:
        return "save"
    return phase


def inject(spec, procs, ref):
    """Places the fault; returns (time of the fault, error text or '')."""
    v = procs[spec.victim]
    sig = signal.SIGKILL if spec.sig == "KILL" else signal.SIGSTOP
    if spec.hook:
        t = v.wait_marker(r"hook ", 240)
        if t is None:
            return None, "the checkpoint hook never fired"
        return t, ""
    pattern, dur = {
        "compile": ("compile-begin", ref.phases.get("compile", 2.0)),
        # the next step (none of these starts or commits a save): a fault at most 25 ms
        # after the marker, so that a fast step is still running when it lands
        "loop": (fr"step {spec.at_step} ", 0.05),
        "save": (fr"save-begin {spec.at_step}$", ref.phases.get("save", 0.5)),
        "restore": ("restore-begin", ref.phases.get("restore", 0.5)),
    }[spec.moment]
    t = v.wait_marker(pattern, 240)
    if t is None:
        return None, f"marker {pattern!r} never came"
    # within the first half of the phase's reference duration (measured on the same loaded
    # machine, but a phase's length varies from run to run)
    time.sleep(max(0.0, t + spec.delay_frac * 0.5 * dur - time.monotonic()))
    try:
        v.p.send_signal(sig)
    except ProcessLookupError:
        return None, "victim already gone"
    return time.monotonic(), ""


def names_victim(text: str, victim: int) -> bool:
    return re.search(rf"\b(rank|process|ranks?\(s\)) {victim}\b", text) is not None


def error_line(proc):
    for _, m in proc.markers():
        if m.startswith("error "):
            return m[6:]
    return ""


def chaos_run(spec: Spec, ref: Reference, root, timeout, limit, hard) -> dict:
    ck = os.path.join(root, f"run{spec.index}")
    shutil.rmtree(ck, ignore_errors=True)
    resume = spec.moment == "restore"
    if resume:
        copy_cut(ref.ckpt, ck, spec.at_step)
    env = {spec.victim: {"CHAOS_SAVE_HOOK": spec.hook}} if spec.hook else {}
    rec = dataclasses.asdict(spec)
    rec["failures"] = []
    procs, store = start(spec.world, worker_args(ck, timeout, resume), env)
    try:
        t_fault, err = inject(spec, procs, ref)
        if t_fault is None:
            rec["failures"].append(f"fault not placed: {err}")
            rec["hit"] = "none"
            return rec
        rec["hit"] = phase_at(procs[spec.victim], t_fault)
        rec["victim_trail"] = [f"{t - t_fault:+.2f} {m}" for t, m in
                               procs[spec.victim].markers() if t <= t_fault][-3:]
        survivors = [p for p in procs if p.rank != spec.victim]
        exits = {}
        for p in survivors:
            ok = p.wait_exit(t_fault + hard)
            if not ok:
                rec["failures"].append(f"rank {p.rank} still running {hard:g} s after the fault "
                                       f"(hang): killed")
                p.kill()
                continue
            exits[p.rank] = p.exit_time - t_fault
            e = error_line(p)
            if rec["hit"] == "after the end":
                if p.p.returncode not in (0, 3):
                    rec["failures"].append(f"rank {p.rank} exited with code {p.p.returncode}")
            elif p.p.returncode != 3 or not e:
                rec["failures"].append(f"rank {p.rank} exited with code {p.p.returncode} "
                                       f"without a Baton error: {p.text()[-1500:]}")
            elif not names_victim(e, spec.victim):
                rec["failures"].append(f"rank {p.rank}'s error does not name rank "
                                       f"{spec.victim}: {e}")
            if exits[p.rank] > limit:
                rec["failures"].append(f"rank {p.rank} took {exits[p.rank]:.1f} s to exit")
        rec["exit_s"] = exits
        rec["errors"] = {p.rank: error_line(p)[:400] for p in survivors}
        v = procs[spec.victim]
        if spec.sig == "STOP":
            t_cont = time.monotonic()
            v.p.send_signal(signal.SIGCONT)
            if not v.wait_exit(t_cont + hard):
                rec["failures"].append(f"thawed rank {spec.victim} still running {hard:g} s "
                                       f"after SIGCONT (hang): killed")
                v.kill()
            else:
                rec["thawed_exit_s"] = v.exit_time - t_cont
                rec["thawed_code"] = v.p.returncode
                rec["thawed_error"] = error_line(v)[:400]
                if v.exit_time - t_cont > limit:
                    rec["failures"].append(f"thawed rank {spec.victim} took "
                                           f"{v.exit_time - t_cont:.1f} s to exit")
        else:
            v.wait_exit(time.monotonic() + 10)
        saved_seen = [int(m.split()[1]) for p in procs for _, m in p.markers()
                      if m.startswith("save-end ")]
        rec["committed_before_resume"] = committed_steps(ck)
        rec["newest_seen_committed"] = max(saved_seen, default=None)
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.p.send_signal(signal.SIGCONT)
            p.kill()
        shutil.rmtree(store, ignore_errors=True)
    verify_resume(rec, spec, ref, ck, timeout)
    shutil.rmtree(ck, ignore_errors=True)
    return rec


def verify_resume(rec, spec, ref, ck, timeout):
    newest = max(rec["committed_before_resume"], default=0)
    seen = rec["newest_seen_committed"]
    if seen is not None and newest < seen:
        rec["failures"].append(f"step {seen} was reported committed but the newest committed "
                               f"checkpoint is {newest}")
    if spec.moment == "restore" and newest < spec.at_step:
        rec["failures"].append(f"the checkpoint of step {spec.at_step} the run resumed from "
                               f"is no longer committed")
    try:
        rp = clean_run(spec.world, ck, timeout, resume=True)
    except Exception as e:  # noqa: BLE001
        rec["failures"].append(f"resume failed: {e}"[:2000])
        rec["resumed_from"] = None
        return
    starts = [int(m.split()[1]) for _, m in rp[0].markers() if m.startswith("start ")]
    rec["resumed_from"] = starts[0] if starts else None
    if rec["resumed_from"] != newest:
        rec["failures"].append(f"resumed from step {rec['resumed_from']}, newest committed "
                               f"is {newest}")
    want = {i: v for i, v in ref.losses.items() if i > newest}
    bad = []
    for p in rp:
        got = losses_of(p)
        if got != want:
            bad.append(p.rank)
    if bad:
        rec["failures"].append(f"resumed losses differ from the reference on ranks {bad}: "
                               f"{losses_of(rp[bad[0]])} vs {want}")
    if done_digest(rp[0]) != ref.digest:
        rec["failures"].append(f"final state digest {done_digest(rp[0])} != reference "
                               f"{ref.digest}")
    rec["resume_verified"] = not bad and done_digest(rp[0]) == ref.digest


def log_line(s, rec) -> str:
    ex = rec.get("exit_s", {})
    return (f"run {s.index:2d}: {s.world} procs, {s.sig:4s} rank {s.victim} at {s.moment}"
            f"{' via hook ' + s.hook if s.hook else ''} -> hit {rec['hit']}; exits "
            f"{', '.join(f'{v:.1f}' for v in ex.values())} s; resumed from "
            f"{rec.get('resumed_from')}; "
            f"{'OK' if not rec['failures'] else 'FAIL: ' + ' | '.join(rec['failures'])[:600]}")


def merge(paths):
    """(records, references, wall seconds) from the ``--jsonl`` files of parallel shards."""
    recs, refs, wall = [], {}, 0.0
    for p in paths:
        for ln in open(p):
            d = json.loads(ln)
            if "ref" in d:
                r = d["ref"]
                r["losses"] = {int(i): v for i, v in r["losses"].items()}
                refs.setdefault(r["world"], Reference(r["world"], r["losses"], r["digest"],
                                                      r["phases"], ""))
            elif "run" in d:
                rec = d["run"]
                rec["exit_s"] = {int(k): v for k, v in rec.get("exit_s", {}).items()}
                rec["errors"] = {int(k): v for k, v in rec.get("errors", {}).items()}
                if any(t.split()[1] == "done" for t in rec.get("victim_trail", [])) and \
                        rec["hit"] != "after the end":
                    # recorded before phase_at knew "done": the victim had finished, so a
                    # survivor's clean exit is right (the rule chaos_run now applies)
                    rec["hit"] = "after the end"
                    rec["failures"] = [f for f in rec["failures"]
                                       if "exited with code 0 without a Baton error" not in f]
                recs.append(rec)
            elif "wall" in d:
                wall = max(wall, d["wall"])
    one = {}
    for r in recs:
        one.setdefault(r["index"], r)
    return sorted(one.values(), key=lambda r: r["index"]), refs, wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="transfer/connect timeout (s)")
    ap.add_argument("--limit", type=float, default=60.0, help="exit limit after a fault (s)")
    ap.add_argument("--hard", type=float, default=90.0, help="kill stragglers after (s)")
    ap.add_argument("--only", type=int, nargs="*", help="run only these run indices")
    ap.add_argument("--shard", help="K/N: run only the runs whose index is K modulo N (start "
                    "N of these in parallel with --jsonl, then --merge their files)")
    ap.add_argument("--reverse", action="store_true",
                    help="the selected runs in reverse order (a helper shard starting from the "
                    "end; --merge keeps one record per run index)")
    ap.add_argument("--refs-from", help="take the references from this --jsonl file ...")
    ap.add_argument("--refs-dir", help="... and their checkpoints from this shard's directory")
    ap.add_argument("--jsonl", help="append each reference and run record here as it ends")
    ap.add_argument("--merge", nargs="+", help="write --out from these --jsonl files only")
    ap.add_argument("--out", default=str(HERE / "results" / "chaos.md"))
    a = ap.parse_args(argv)
    if a.merge:
        recs, refs, wall = merge(a.merge)
        write_report(a, recs, refs, wall)
        return 1 if any(r["failures"] for r in recs) else 0
    rng = random.Random(a.seed)
    specs = plan_runs(a.runs, rng)
    if a.only:
        specs = [s for s in specs if s.index in a.only]
    if a.shard:
        k, n = map(int, a.shard.split("/"))
        specs = [s for s in specs if s.index % n == k]
    if a.reverse:
        specs.reverse()
    sink = open(a.jsonl, "a") if a.jsonl else None

    def emit(d):
        if sink:
            sink.write(json.dumps(d, default=str) + "\n")
            sink.flush()

    root = tempfile.mkdtemp(prefix="chaos-")
    t0 = time.monotonic()
    refs = {}
    if a.refs_from:  # another shard's references: its records and a copy of its checkpoints
        for ln in open(a.refs_from):
            r = json.loads(ln).get("ref")
            if r:
                r["losses"] = {int(i): v for i, v in r["losses"].items()}
                ck = os.path.join(root, f"ref{r['world']}")
                shutil.copytree(os.path.join(a.refs_dir, f"ref{r['world']}"), ck)
                refs[r["world"]] = Reference(r["world"], r["losses"], r["digest"], r["phases"],
                                             ck)
                emit({"ref": r})
    for w in sorted({s.world for s in specs} - set(refs)):
        print(f"reference run, {w} processes ...", flush=True)
        refs[w] = reference(w, root, a.timeout)
        emit({"ref": dict(world=w, losses=refs[w].losses, digest=refs[w].digest,
                          phases=refs[w].phases)})
        print(f"  phases {json.dumps({k: round(v, 3) for k, v in refs[w].phases.items()})}",
              flush=True)
    recs = []
    for s in specs:
        rec = chaos_run(s, refs[s.world], root, a.timeout, a.limit, a.hard)
        recs.append(rec)
        emit({"run": rec})
        print(log_line(s, rec), flush=True)
    elapsed = time.monotonic() - t0
    emit({"wall": elapsed})
    shutil.rmtree(root, ignore_errors=True)
    if not a.jsonl:
        write_report(a, recs, refs, elapsed)
    return 1 if any(r["failures"] for r in recs) else 0


def write_report(a, recs, refs, elapsed):
    from chaos_report import report

    pathlib.Path(a.out).write_text(report(a, recs, refs, elapsed))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
