"""Train tiny MaxText models as Baton pipelines and print the losses next to MaxText's own.

    bash scripts/setup_maxtext.sh      # once: .venv-maxtext with Baton and MaxText 0.2.5
    JAX_NUM_CPU_DEVICES=4 .venv-maxtext/bin/python examples/maxtext_pipeline.py
    JAX_NUM_CPU_DEVICES=4 .venv-maxtext/bin/python examples/maxtext_pipeline.py \\
        --model mixtral --schedules 1f1b --steps 5

For each model (a Llama-2, a Mixtral MoE and a DeepSeek-V2 MoE, built by MaxText's own config
system at its defaults, scanned layers included, and shrunk to 4 or 5 layers of width 64) and
each schedule, the model is cut into 4 stages (a scan per stage and stack; the embedding joins
the first, the output head and loss the last) over 4 devices, and
trained for ``--steps`` steps on synthetic batches of 8 sequences in 4 microbatches with
MaxText's loss, gradient clipping and AdamW. MaxText's own ``train_step`` (not pipelined) runs
on the same batches from the same initial state. See ``baton.integrations.maxtext``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402

import baton  # noqa: E402
from baton.integrations import maxtext as bmt  # noqa: E402

RANKS = 4


def run(name: str, schedules: list[str], steps: int, batch: int, microbatches: int) -> float:
    """Trains ``name`` with each schedule; returns the largest relative loss difference."""
    m = bmt.build(name, batch=batch)
    batches = [m.make_batch(seed) for seed in range(steps)]
    # MaxText's own step: the full batch at once for the dense model, its own gradient
    # accumulation over the same microbatches for the MoE (either matches the pipeline).
    ga = 1 if m.config.num_experts <= 1 else microbatches
    ref, state = m.reference_step(grad_accum=ga), m.reference_state()
    want = []
    for b in batches:
        state, loss = ref(state, b)
        want.append(float(loss))
    mesh = bmt.pipeline_mesh(m, RANKS)
    worst = 0.0
    print(f"\n{m.config.model_name} (tiny: {m.num_layers} layers, emb {m.config.emb_dim}, "
          f"experts {m.config.num_experts}), batch {batch}, {microbatches} microbatches, "
          f"{RANKS} ranks; MaxText's own step: gradient_accumulation_steps={ga}")
    for sname in schedules:
        schedule = baton.schedule_from_name(sname)
        step = m.pipeline_step(mesh, schedule, microbatches=microbatches)
        params = m.init_params(stages=schedule.stages(RANKS))  # each rank: its scanned layers
        opt_state = m.init_opt_state(params)
        summary = step.summary(params, opt_state, batches[0]).splitlines()
        facts = {ln.split()[0]: ln.split()[-1] for ln in summary
                 if ln.split() and ln.split()[0] in ("bubble", "verification:")}
        print(f"  {schedule}: {schedule.stages(RANKS)} stages; plan {facts.get('verification:')}, "
              f"predicted bubble {facts.get('bubble')}")
        print(f"    {'step':>4}  {'baton':>12}  {'maxtext':>12}  {'rel. diff':>9}  {'time':>7}")
        for i, (b, w) in enumerate(zip(batches, want)):
            t = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, b)
            loss = float(loss)
            dt = time.perf_counter() - t
            rel = abs(loss - w) / abs(w)
            worst = max(worst, rel)
            print(f"    {i:>4}  {loss:>12.7f}  {w:>12.7f}  {rel:>9.1e}  {dt:>6.2f}s")
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["llama2", "mixtral", "deepseek2", "all"], default="all")
    ap.add_argument("--schedules", default="1f1b,zbh1",
                    help="comma-separated schedule names (baton.schedule_names())")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    if len(jax.devices()) < RANKS:
        print(f"need {RANKS} devices; set JAX_NUM_CPU_DEVICES={RANKS}", file=sys.stderr)
        return 2
    names = ["llama2", "mixtral", "deepseek2"] if args.model == "all" else [args.model]
    worst = max(run(n, args.schedules.split(","), args.steps, args.batch, args.microbatches)
                for n in names)
    print(f"\nlargest relative loss difference from MaxText's own step: {worst:.1e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
