"""Soak: a long multi-process training run of the GPT example, sampling each process's
resources every ``--every`` steps.

    python bench/soak.py --steps 5000 [--every 100] [--warmup 1000] [--out bench/results/soak.md]

Starts ``python -m baton.launch --nprocs 2`` on this script (worker mode): the GPT of
examples/gpt.py (dim 32, 2 blocks, 2 heads, vocabulary 64, sequence 16; one block per stage,
one stage per process, 1F1B, 4 microbatches of 2 sequences, AdamW), a new batch every step
(examples/train_lm.py's ``Batches``). Every ``--every`` steps each process records its
resident memory (``VmRSS``), the number of live JAX arrays (``len(jax.live_arrays())``), its
open file descriptors (``/proc/self/fd``) and its threads (``Threads`` in
``/proc/self/status``: every OS thread, Gloo's and XLA's included) into
``<dir>/samples-rank<r>.jsonl``. The verdict: after the warm-up, no quantity of any process
grows by more than 1% (the largest sample after the warm-up against the sample at its end).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
KEYS = ("rss_kib", "live_arrays", "fds", "threads")


def sample(step: int, t0: float) -> dict:
    import jax

    status = pathlib.Path("/proc/self/status").read_text().splitlines()
    field = {ln.split(":")[0]: ln.split(":")[1].split() for ln in status if ":" in ln}
    return dict(step=step, t=round(time.monotonic() - t0, 2), rss_kib=int(field["VmRSS"][0]),
                live_arrays=len(jax.live_arrays()), fds=len(os.listdir("/proc/self/fd")),
                threads=int(field["Threads"][0]))


def worker(a) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(EXAMPLES))
    import gpt
    from train_lm import Batches

    import baton
    from baton.running.distributed import process_group

    group = process_group()
    rank, world = group.rank, group.world_size
    cfg = gpt.GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=world, stages=world)
    _, params, _, opt_state, train_step, _ = gpt.make(cfg, lr=1e-3, seed=0)
    step_fn = baton.jit(train_step, schedule=baton.OneFOneB(), microbatches=4)
    data = Batches(None, 8, cfg.seq, cfg.vocab, 0)
    out = open(pathlib.Path(a.dir) / f"samples-rank{rank}.jsonl", "w")
    t0 = time.monotonic()
    for i in range(1, a.steps + 1):
        params, opt_state, loss = step_fn(params, opt_state, data(i))
        if i % a.every == 0 or i == 1:
            s = sample(i, t0)
            s["loss"] = float(loss)
            out.write(json.dumps(s) + "\n")
            out.flush()
            if rank == 0:
                print(f"step {i} {json.dumps(s)}", flush=True)
    out.close()
    return 0


WINDOW = 10  # samples per window of the growth measure


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def verdict(rows: list[dict], warmup: int) -> dict:
    """Per quantity: the sample at the end of the warm-up, the largest after it, the last,
    and the growth: median of the last ``WINDOW`` samples / median of the first ``WINDOW``
    samples from the warm-up's end on - 1 (medians: a transfer's short-lived thread that is
    alive at one sample is not growth)."""
    later = [r for r in rows if r["step"] >= warmup]
    w = max(1, min(WINDOW, len(later) // 2))
    out = {}
    for k in KEYS:
        head, tail = _median([r[k] for r in later[:w]]), _median([r[k] for r in later[-w:]])
        out[k] = dict(first=rows[0][k], warm=later[0][k], max=max(r[k] for r in later),
                      last=later[-1][k], head=head, tail=tail,
                      growth=(tail - head) / head if head else float(tail > 0))
    return out


def report(a, rows_by_rank, elapsed) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    lines = [
        "# Soak: 5,000 steps of the GPT example on 2 processes",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Commit {commit} (plus "
        f"this change's files). Machine: 2-core VM, no GPU, CPU JAX, **loaded by parallel "
        f"work** (run under `nice -n 10`; the times are not a benchmark). Wall time "
        f"{elapsed / 60:.1f} min.",
        "",
        f"Command: `nice -n 10 .venv/bin/python bench/soak.py --steps {a.steps} --every "
        f"{a.every} --warmup {a.warmup}` (GPT of examples/gpt.py: dim 32, 2 blocks, 2 heads, "
        f"vocabulary 64, sequence 16, one block per stage and process, 1F1B, 4 microbatches, "
        f"AdamW, a new batch every step; `python -m baton.launch --nprocs 2`, Gloo).",
        "",
        f"Sampled every {a.every} steps in each process: resident memory (VmRSS), live JAX "
        f"arrays (`len(jax.live_arrays())`), open file descriptors (`/proc/self/fd`), OS "
        f"threads (`Threads` of `/proc/self/status`). Growth = (median of the last {WINDOW} "
        f"samples) / (median of the first {WINDOW} samples from step {a.warmup} on) - 1; "
        f"flat means <= 1%. Medians, because each Gloo transfer runs on a short-lived thread, "
        f"so one sample may count one more thread than the next; the largest sample is shown "
        f"too.",
        "",
        "| process | quantity | step 1 | step " + str(a.warmup) + " | max after | last | "
        "median first / last window | growth | flat |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for r, rows in sorted(rows_by_rank.items()):
        v = verdict(rows, a.warmup)
        for k in KEYS:
            x = v[k]
            flat = x["growth"] <= 0.01
            ok &= flat
            lines.append(f"| {r} | {k} | {x['first']} | {x['warm']} | {x['max']} | {x['last']} "
                         f"| {x['head']} / {x['tail']} | {100 * x['growth']:.2f}% | "
                         f"{'yes' if flat else 'NO'} |")
    lines += ["", f"Verdict: **{'flat' if ok else 'GROWS'}** after the warm-up "
              f"({len(rows_by_rank)} processes, {a.steps} steps).", "",
              "Every sample (process 0 / process 1):", "",
              "| step | s | RSS KiB | live arrays | fds | threads | loss |",
              "|---|---|---|---|---|---|---|"]
    for s, q in zip(rows_by_rank[0], rows_by_rank[1]):
        lines.append(f"| {s['step']} | {s['t']} | {s['rss_kib']} / {q['rss_kib']} | "
                     f"{s['live_arrays']} / {q['live_arrays']} | {s['fds']} / {q['fds']} | "
                     f"{s['threads']} / {q['threads']} | {s['loss']:.4f} |")
    lines.append("")
    return "\n".join(lines), ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--dir", help="(worker) where to write the samples")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results" / "soak.md"))
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    d = tempfile.mkdtemp(prefix="soak-")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "baton.launch", "--nprocs", str(a.nprocs),
                        str(pathlib.Path(__file__).resolve()), "--worker", "--dir", d,
                        "--steps", str(a.steps), "--every", str(a.every)], env=env)
    elapsed = time.monotonic() - t0
    if p.returncode != 0:
        print(f"soak run failed with code {p.returncode}", file=sys.stderr)
        return 1
    rows = {r: [json.loads(ln) for ln in open(os.path.join(d, f"samples-rank{r}.jsonl"))]
            for r in range(a.nprocs)}
    pathlib.Path(a.out + ".json").write_text(json.dumps(rows))
    text, ok = report(a, rows, elapsed)
    pathlib.Path(a.out).write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
