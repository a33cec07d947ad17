"""Markdown report of bench/chaos.py's runs."""

from __future__ import annotations

import collections
import subprocess
import sys
import time


def _pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def report(a, recs, refs, elapsed) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    late = [r for r in recs if r["hit"] == "after the end"]
    recs_all, recs = recs, [r for r in recs if r["hit"] != "after the end"]
    exits = [v for r in recs for v in r.get("exit_s", {}).values()]
    thawed = [r["thawed_exit_s"] for r in recs if "thawed_exit_s" in r]
    failed = [r for r in recs if r["failures"]]
    verified = sum(1 for r in recs if r.get("resume_verified"))
    by = collections.Counter((r["sig"], r["moment"]) for r in recs)
    hit = collections.Counter(r["hit"] for r in recs)
    worlds = collections.Counter(r["world"] for r in recs)
    out = [
        "# Chaos runs: killed and frozen processes in multi-process training",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Commit {commit} (the "
        f"runs used the worktree at that commit plus the files of this change). Machine: "
        f"2-core VM, no GPU, CPU JAX, **loaded by parallel work** (other builds and test "
        f"runs shared the 2 cores; the runs were started under `nice -n 10`), so exit times "
        f"are upper bounds. Total wall time {elapsed / 60:.1f} min.",
        "",
        (f"Command: {len(a.merge)} invocations of `nice -n 10 .venv/bin/python bench/chaos.py "
         f"--runs {a.runs} --seed {a.seed} --timeout {a.timeout:g} --jsonl chaos-K.jsonl` each "
         f"over part of the seeded plan (`--shard` / `--only`; up to 4 at once, so each run's "
         f"exit times include the others' load), then `bench/chaos.py --runs {a.runs} --merge "
         f"chaos-*.jsonl`; see the notes at the end" if getattr(a, "merge", None) else
         f"Command: `nice -n 10 .venv/bin/python bench/chaos.py --runs {a.runs} --seed {a.seed}"
         f" --timeout {a.timeout:g}`") + f" (worker: `bench/chaos_worker.py`: 12-layer tanh MLP, dim "
        f"16, one stage per process, 1F1B, 4 microbatches, AdamW, 12 steps, checkpoint every "
        f"3 steps, async save committed after the next step; transfer and connect timeout "
        f"{a.timeout:g} s).",
        "",
        "## Summary",
        "",
        f"- Runs with a fault: **{len(recs)}** ({', '.join(f'{n} with {w} processes' for w, n in sorted(worlds.items()))}).",
        *([f"- Not counted: {len(late)} run(s) whose fault landed after the victim had "
           f"finished training (runs {', '.join(str(r['index']) for r in late)}): the "
           f"survivors rightly exited 0; their resume check still ran."] if late else []),
        f"- Faults: " + ", ".join(f"{s} during {m}: {n}" for (s, m), n in sorted(by.items())) + ".",
        f"- Phase the victim was in when hit (from its last marker): " +
        ", ".join(f"{k}: {n}" for k, n in sorted(hit.items())) + ".",
        f"- Survivor exit time after the fault ({len(exits)} processes): max "
        f"**{max(exits, default=float('nan')):.1f} s**, p50 **{_pct(exits, 0.5):.1f} s**, "
        f"p90 {_pct(exits, 0.9):.1f} s (limit {a.limit:g} s; a SIGSTOPped peer is detected "
        f"by the {a.timeout:g} s transfer timeout).",
        f"- Frozen victims thawed (SIGCONT) after the others exited: {len(thawed)}, exit time "
        f"max {max(thawed, default=float('nan')):.1f} s, p50 {_pct(thawed, 0.5):.1f} s.",
        f"- Resumes verified (losses of every later step bit-identical to the reference as "
        f"float.hex, final state's SHA-256 digest identical): **{verified} / {len(recs)}**.",
        f"- Runs with a failure: **{len(failed)}**.",
        "",
        "Reference runs (never stopped), per world size: phase durations in seconds "
        "(compile includes the Gloo connect; step is the mean step):",
        "",
        "| processes | compile | step | save (begin to commit) | restore | final digest |",
        "|---|---|---|---|---|---|",
    ]
    for w, r in sorted(refs.items()):
        ph = r.phases
        out.append(f"| {w} | {ph.get('compile', 0):.2f} | {ph.get('step', 0):.3f} | "
                   f"{ph.get('save', 0):.2f} | {ph.get('restore', 0):.2f} | {r.digest} |")
    out += ["", "## Runs", "",
            "| # | procs | signal | victim | planned moment | hit | survivors' exit (s) | "
            "thawed exit (s) | committed | resumed from | verified | result |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs_all:
        moment = r["moment"] + (f" (hook {r['hook'].split(':')[0]}, step {r['at_step']})"
                                if r["hook"] else
                                f" (step {r['at_step']})" if r["at_step"] else "")
        ex = ", ".join(f"r{k}: {v:.1f}" for k, v in r.get("exit_s", {}).items())
        th = f"{r['thawed_exit_s']:.1f}" if "thawed_exit_s" in r else "-"
        res = "ok" if not r["failures"] else "FAIL: " + "; ".join(r["failures"])[:300]
        out.append(f"| {r['index']} | {r['world']} | {r['sig']} | {r['victim']} | {moment} | "
                   f"{r['hit']} | {ex} | {th} | {r.get('committed_before_resume')} | "
                   f"{r.get('resumed_from')} | {'yes' if r.get('resume_verified') else 'no'} | "
                   f"{res} |")
    out += ["", "## Survivors' errors (one per kind)", ""]
    seen = set()
    for r in recs:
        for rank, e in r.get("errors", {}).items():
            key = (r["sig"], r["hit"].split()[0], e.split(":")[0])
            if key in seen or not e:
                continue
            seen.add(key)
            out.append(f"- {r['sig']} rank {r['victim']} during {r['hit']} -> rank {rank}: "
                       f"`{e[:300]}`")
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit("import me")
