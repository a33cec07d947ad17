"""``baton-plan --model NAME --cluster NAME --gpus N --global-batch B [--seq S]``: traces
the model abstractly, then runs the cluster search of the C++ core (``baton-plan`` hands
``--model`` command lines to this script, installed as ``baton-plan-model``)."""

from __future__ import annotations

import argparse
import json
import sys


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {s!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="baton-plan", description=__doc__)
    ap.add_argument("--model", required=True, help="model name (baton.scale.MODELS) or gpt:/llama: spec")
    ap.add_argument("--cluster", required=True, help="preset (a100, h100, h200, b200) or JSON file")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's)")
    ap.add_argument("--fp8", action="store_true",
                    help="linear layers in fp8 at the hardware file's fp8 GEMM rates (casts counted)")
    ap.add_argument("--pp", type=_ints, default=[])
    ap.add_argument("--tp", type=_ints, default=[])
    ap.add_argument("--ep", type=_ints, default=[])
    ap.add_argument("--fsdp", choices=["yes", "no"], default=None)
    ap.add_argument("--tp-overlap", choices=["yes", "no"], default=None,
                    help="TP communication overlapped with the GEMMs (default: both searched)")
    ap.add_argument("--dp-overlap", choices=["yes", "no"], default=None,
                    help="bucketed gradient reduction overlapped with the backward (default: both)")
    ap.add_argument("--grad-reduce-bytes", type=float, default=4.0,
                    help="bytes per gradient element in the data-parallel reduction (4: fp32)")
    ap.add_argument("--offload", choices=["yes", "no"], default=None,
                    help="plans over the memory budget may offload stashes to host memory over "
                         "the cluster's host_link (default: when the cluster file has one)")
    ap.add_argument("--families", default="", help="comma list of schedules (default: all)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", default=None, help="write the ranked plans as JSON")
    ap.add_argument("--profile-out", default=None, help="write the traced model profile JSON")
    a = ap.parse_args(argv)
    from ..errors import BatonError
    from .plan import plan_cluster
    from .profile import profile_model

    try:
        prof = profile_model(a.model, a.seq)
        if a.profile_out:
            with open(a.profile_out, "w") as f:
                json.dump(prof, f, indent=1)
        r = plan_cluster(prof, a.cluster, a.gpus, a.global_batch, fp8=a.fp8, pp=a.pp, tp=a.tp,
                         ep=a.ep, fsdp=None if a.fsdp is None else a.fsdp == "yes",
                         families=[f for f in a.families.split(",") if f], top=a.top,
                         tp_overlap=None if a.tp_overlap is None else a.tp_overlap == "yes",
                         dp_overlap=None if a.dp_overlap is None else a.dp_overlap == "yes",
                         grad_reduce_bytes=a.grad_reduce_bytes,
                         offload=None if a.offload is None else a.offload == "yes")
    except (BatonError, ValueError) as e:
        print(f"baton-plan: error: {e}", file=sys.stderr)
        return 1
    params = sum(s["params"] * s["repeat"] for s in prof["segments"])
    print(f"{prof['name']}: {params / 1e9:.1f}B parameters, {a.gpus} GPUs ({r.hardware['name']}), "
          f"global batch {a.global_batch} x {prof['seq']} tokens")
    print(r.table())
    print(r.breakdown())
    if a.json:
        import dataclasses
        with open(a.json, "w") as f:
            json.dump({"plans": [dataclasses.asdict(p) for p in r.plans], "stats": r.stats}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
