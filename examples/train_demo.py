"""Train the GPT example for a few steps on CPU devices with a chosen pipeline schedule.

    JAX_NUM_CPU_DEVICES=4 python examples/train_demo.py --schedule zbh1 --ranks 4 --steps 5

Prints the plan summary (predicted step time, bubble, peak memory per rank, from
the simulator on the traced task costs), the loss per step, and the measured
peak live buffers per rank next to the plan's prediction.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402

import baton  # noqa: E402

SCHEDULES = {
    "gpipe": lambda v: baton.GPipe(),
    "1f1b": lambda v: baton.OneFOneB(),
    "eager1f1b": lambda v: baton.Eager1F1B(),
    "interleaved": lambda v: baton.Interleaved1F1B(virtual_stages=v),
    "zbh1": lambda v: baton.ZBH1(),
    "zbh2": lambda v: baton.ZBH2(),
    "zbv": lambda v: baton.ZBV(),
    "dualpipev": lambda v: baton.DualPipeV(),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b",
                    help=f"one of {', '.join(SCHEDULES)}, or a schedule text file")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--devices-per-rank", type=int, default=1)
    ap.add_argument("--virtual-stages", type=int, default=2, help="for --schedule interleaved")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers-per-stage", type=int, default=1)
    ap.add_argument("--dim", type=int, default=32)
    args = ap.parse_args(argv)

    if args.schedule in SCHEDULES:
        spec = SCHEDULES[args.schedule](args.virtual_stages)
    else:
        spec = baton.ScheduleFile(args.schedule)
    n_dev = args.ranks * args.devices_per_rank
    if len(jax.devices()) < n_dev:
        print(f"need {n_dev} devices; set JAX_NUM_CPU_DEVICES={n_dev}", file=sys.stderr)
        return 2
    stages = spec.stages(args.ranks)
    cfg = gpt.GPTConfig(stages=stages, layers=stages * args.layers_per_stage, dim=args.dim)
    model, params, opt, opt_state, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, args.batch)
    mesh = baton.PipelineMesh(jax.devices()[:n_dev], ranks=args.ranks)
    # ranks of several devices run on the interpreter (the compiled engine refuses them)
    step = baton.jit(train_step, mesh=mesh, schedule=spec, microbatches=args.microbatches,
                     engine="compiled" if args.devices_per_rank == 1 else "interpreter")

    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"GPT: {cfg.layers} blocks, dim {cfg.dim}, vocab {cfg.vocab}, {n_params} parameters; "
          f"{stages} stages on {args.ranks} ranks x {args.devices_per_rank} device(s); "
          f"{args.microbatches} microbatches of {args.batch // args.microbatches}")
    t0 = time.time()
    step.compile(params, opt_state, batch)
    print(f"traced, partitioned and planned in {time.time() - t0:.1f}s\n")
    print(step.summary())
    print("(times in units of the largest forward task, from traced flop counts)\n")
    for i in range(args.steps):
        t = time.time()
        params, opt_state, loss = step(params, opt_state, batch)
        loss = float(loss)
        print(f"step {i}: loss {loss:.4f}  ({time.time() - t:.2f}s)")
    # one traced step: its buffers replayed at their measured times with the plan's sizes
    measured = list(baton.trace(step, params, opt_state, batch).peak_total)
    predicted = list(step.simulate().peak_total)
    print("\npeak live buffers per rank (traced step / predicted):",
          ", ".join(f"r{r}: {m} / {p} B" for r, (m, p) in enumerate(zip(measured, predicted))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
