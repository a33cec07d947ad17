"""Train a GPT language model with a Baton pipeline: the script to copy for a real run.

    # one process, 4 ranks on 4 CPU devices, synthetic tokens
    JAX_NUM_CPU_DEVICES=4 python examples/train_lm.py --ranks 4 --steps 50
    # a tokenized file (uint16 token ids, nanoGPT's train.bin layout) or any text file (bytes)
    python examples/train_lm.py --data train.bin --vocab 50304 ...
    # checkpoints every 100 steps; continue the newest one after a stop
    python examples/train_lm.py --ckpt runs/lm --ckpt-every 100 --resume
    # one process per rank (here 4 processes on this machine; see README "Several processes")
    python -m baton.launch --nprocs 4 examples/train_lm.py --steps 50
    # under SLURM (examples/launch/train_lm.sbatch): jax.distributed.initialize() first
    # the layout in configuration: any schedule (Baton's, torchtitan's or Megatron's name),
    # microbatch size, layers per stage; the model marks every block end once
    python examples/train_lm.py --schedule ZBVZeroBubble --layers 8 --microbatch-size 2
    # metrics (step time, tokens/s, MFU, each rank's idle fraction and memory) to TensorBoard
    python examples/train_lm.py --tensorboard runs/tb --metrics-every 5

The data order is a function of the step number alone, so a resumed run sees the same batches
as one that never stopped, and its losses are the same, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402

import baton  # noqa: E402
from baton import checkpoint as ckpt  # noqa: E402
from baton import metrics  # noqa: E402


def start_distributed() -> bool:
    """Whether this process is one of several. Under SLURM or Open MPI with several tasks, or
    with ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set (the
    Kubernetes JobSet recipe), ``jax.distributed.initialize()`` first (it reads the
    launcher's variables; Baton's rendezvous then uses its key-value store);
    ``python -m baton.launch`` needs none (its processes meet in a file store)."""
    if "BATON_RANK" in os.environ:
        return True
    if "JAX_COORDINATOR_ADDRESS" in os.environ:  # e.g. examples/launch/jobset.yaml
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                                   int(os.environ["JAX_NUM_PROCESSES"]),
                                   int(os.environ["JAX_PROCESS_ID"]))
        return True
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(os.environ.get(var, "1")) > 1:
            jax.distributed.initialize()
            return True
    return False


class Batches:
    """Batch ``i`` of (tokens, targets) from step number ``i`` alone (a resumed run sees the same
    batches). Synthetic: random tokens. A file: ``.bin``/``.npy`` of uint16 token ids, or any
    other file as bytes (vocabulary 256); each row is a random window of the token stream."""

    def __init__(self, path: str | None, batch: int, seq: int, vocab: int, seed: int):
        self.batch, self.seq, self.vocab, self.seed = batch, seq, vocab, seed
        self.tokens = None
        if path:
            if path.endswith(".npy"):
                self.tokens = np.load(path, mmap_mode="r")
            elif path.endswith(".bin"):
                self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
            else:
                self.tokens = np.frombuffer(open(path, "rb").read(), dtype=np.uint8)
            if len(self.tokens) <= seq + 1:
                raise SystemExit(f"{path}: {len(self.tokens)} tokens, need more than {seq + 1}")
            top = int(np.max(self.tokens))
            if top >= vocab:
                raise SystemExit(f"{path}: token id {top} >= --vocab {vocab}")

    def __call__(self, i: int):
        rng = np.random.default_rng([self.seed, i])
        if self.tokens is None:
            rows = rng.integers(0, self.vocab, (self.batch, self.seq + 1))
        else:
            starts = rng.integers(0, len(self.tokens) - self.seq - 1, self.batch)
            rows = np.stack([np.asarray(self.tokens[s:s + self.seq + 1]) for s in starts])
        rows = rows.astype(np.int32)
        return rows[:, :-1], rows[:, 1:]


def progress(step: int, total: int, loss: float, tok_s: float, width: int = 24) -> str:
    done = int(width * step / max(total, 1))
    return (f"[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}  "
            f"{tok_s:,.0f} tokens/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b",
                    help="a schedule name: Baton's (1f1b, zbv, dualpipev ...), torchtitan's "
                    "(1F1B, ZBVZeroBubble, DualPipeV ...) or Megatron-LM's")
    ap.add_argument("--ranks", type=int, default=4, help="pipeline ranks (one process)")
    ap.add_argument("--microbatches", type=int, default=None, help="count (default 8)")
    ap.add_argument("--microbatch-size", type=int, default=None,
                    help="sequences per microbatch (instead of --microbatches)")
    ap.add_argument("--layers", type=int, default=None,
                    help="GPT blocks (default: the schedule's stages x --layers-per-stage)")
    ap.add_argument("--first-stage-layers", type=int, default=None)
    ap.add_argument("--last-stage-layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers-per-stage", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=20, help="train until this step")
    ap.add_argument("--data", help="token file (.bin uint16 / .npy) or text file; "
                    "default: synthetic tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt", help="checkpoint directory")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (0: never)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--print-losses", action="store_true",
                    help="print every step's loss exactly (one line each)")
    ap.add_argument("--tensorboard", help="write metrics to a TensorBoard event file here")
    ap.add_argument("--wandb-project", help="also log metrics to this W&B project")
    ap.add_argument("--metrics-every", type=int, default=1,
                    help="traced step (idle, memory per rank) every N steps")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="per-device peak TFLOP/s for the MFU (the datasheet figure for the "
                    "dtype; default: the measured float32 matmul rate of this device)")
    args = ap.parse_args(argv)

    launched = start_distributed()  # several processes: one rank each
    # the pipeline layout as configuration (baton.PipelineConfig): no model edit changes it
    pipe = baton.PipelineConfig.from_dict({
        "schedule": args.schedule,
        **({"microbatch_size": args.microbatch_size} if args.microbatch_size
           else {"microbatches": args.microbatches or 8}),
        **({"first_stage_layers": args.first_stage_layers}
           if args.first_stage_layers is not None else {}),
        **({"last_stage_layers": args.last_stage_layers}
           if args.last_stage_layers is not None else {})})
    if launched:  # one rank per process: the launcher's world size is the rank count
        mesh = None
        ranks = (int(os.environ["BATON_WORLD_SIZE"]) if "BATON_WORLD_SIZE" in os.environ
                 else jax.process_count())
    else:
        ranks = args.ranks
        if len(jax.devices()) < ranks:
            print(f"need {ranks} devices; set JAX_NUM_CPU_DEVICES={ranks}", file=sys.stderr)
            return 2
        mesh = baton.PipelineMesh(jax.devices()[:ranks], ranks=ranks)
    data = Batches(args.data, args.batch, args.seq, args.vocab, args.seed)
    # every block ends with a stage_boundary mark (stages=layers); the layout picks the cuts
    layers = args.layers or pipe.spec().stages(ranks) * args.layers_per_stage
    cfg = gpt.GPTConfig(vocab=args.vocab, seq=args.seq, dim=args.dim, heads=args.heads,
                        layers=layers, stages=layers)
    _, params, _, opt_state, train_step, _ = gpt.make(cfg, lr=args.lr, seed=args.seed)
    step_fn = baton.jit(train_step, mesh=mesh, **pipe.jit_kwargs())
    rank = step_fn.ranks[0]
    say = print if rank == 0 else (lambda *a, **k: None)

    start = 0
    if args.resume:
        if not args.ckpt:
            raise SystemExit("--resume needs --ckpt")
        last = ckpt.latest_step(args.ckpt)
        if last is None:
            say(f"no checkpoint in {args.ckpt}: starting from step 0")
        else:
            step_fn.compile(params, opt_state, data(0))  # plan the step, then place the state
            params, opt_state = ckpt.restore(args.ckpt, last, fn=step_fn)
            start = last
            say(f"resumed from step {last} of {args.ckpt}")
    n = sum(x.size for x in jax.tree.leaves(params) if hasattr(x, "size"))
    say(f"GPT {cfg.layers} blocks, dim {cfg.dim}, vocab {cfg.vocab} ({n:,} parameters); "
        f"{args.schedule} over {ranks} ranks ({'launched' if launched else 'one process'}), "
        + (f"microbatches of {args.microbatch_size} sequences" if args.microbatch_size
           else f"{args.microbatches or 8} microbatches"))

    writer = open_metrics(args, rank, launched)
    peak = None
    if writer is not None:
        peak = (args.peak_tflops * 1e12 if args.peak_tflops
                else metrics.measured_matmul_flops())
    tokens = args.batch * args.seq
    t_log, n_log = time.perf_counter(), 0
    for i in range(start + 1, args.steps + 1):
        measure = (writer is not None and i > start + 1
                   and (i % args.metrics_every == 0 or i == args.steps))
        if measure:  # a traced step: each rank's measured idle time and buffers
            t0 = time.perf_counter()
            tr = baton.trace(step_fn, params, opt_state, data(i - 1))
            params, opt_state, loss = tr.outputs
            jax.block_until_ready(loss)
            writer.write(metrics.step_metrics(step_fn, i, time.perf_counter() - t0, tokens,
                                              trace=tr, peak_flops=peak, loss=float(loss)))
        else:
            params, opt_state, loss = step_fn(params, opt_state, data(i - 1))
        n_log += 1
        if args.print_losses:
            say(f"loss {i} {float(loss)!r}")
        if i % args.log_every == 0 or i == args.steps:
            loss = float(loss)  # waits for the step
            now = time.perf_counter()
            line = progress(i, args.steps, loss, n_log * tokens / (now - t_log))
            if i == start + 1:  # the first call traces and compiles the step
                line = line.rsplit("  ", 1)[0] + "  (first call: includes compiling)"
            if args.print_losses or not sys.stdout.isatty():
                say(line)
            else:
                say("\r" + line, end="", flush=True)
            t_log, n_log = now, 0
        if args.ckpt and args.ckpt_every and i % args.ckpt_every == 0:
            ckpt.save(args.ckpt, i, (params, opt_state), step_fn, overwrite=True)
    if args.ckpt:
        ckpt.wait_until_finished()  # commit the last save before the program ends
    if writer is not None:
        writer.close()
    say("")
    return 0


def open_metrics(args, rank: int, launched: bool):
    """The metrics hook (TensorBoard and/or W&B), or None. Several processes: each writes
    its own ranks' measures (its own event file: ``<dir>/rank<r>``)."""
    ws = []
    if args.tensorboard:
        logdir = os.path.join(args.tensorboard, f"rank{rank}") if launched else args.tensorboard
        ws.append(metrics.TensorBoardWriter(logdir))
    if args.wandb_project and rank == 0:
        ws.append(metrics.WandbWriter(project=args.wandb_project))
    return metrics.writers(ws) if ws else None


if __name__ == "__main__":
    sys.exit(main())
