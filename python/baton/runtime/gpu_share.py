"""The environment of processes that share a GPU (used by :mod:`baton.launch`).

Two settings a GPU process needs before CUDA starts in it:

* its part of the GPU's memory when other processes share that GPU: XLA preallocates
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the device's memory (0.75 by default), so two
  processes that each take the default cannot both start;
* ``CUDA_MODULE_LOADING=EAGER`` unless the user chose a mode: with CUDA's lazy loading (the
  default since CUDA 12.2), the first step's NCCL calls on several threads can race the
  driver's loading of modules and deadlock inside it (docs/GPU.md, "First-step module
  loading").
"""

from __future__ import annotations

# XLA's default share of GPU memory for its pool (XLA_PYTHON_CLIENT_MEM_FRACTION unset):
# JAX's "GPU memory allocation" page.
XLA_DEFAULT_MEM_FRACTION = 0.75


def gpu_share_env(rank: int, nprocs: int, gpus: list[str], environ) -> dict:
    """The variables process ``rank`` gets besides its GPU (``pinned_gpu``): each process
    that shares its GPU with others gets its part of the memory XLA may take
    (``XLA_PYTHON_CLIENT_MEM_FRACTION``: the fraction ``environ`` sets, else XLA's default
    0.75, divided by the sharers), and ``CUDA_MODULE_LOADING=EAGER`` unless ``environ`` sets
    a mode. ``gpus``: the launcher's visible GPUs (empty: no GPUs, no memory share)."""
    env = {}
    if "CUDA_MODULE_LOADING" not in environ:
        env["CUDA_MODULE_LOADING"] = "EAGER"
    if not gpus:
        return env
    sharers = len(range(rank % len(gpus), nprocs, len(gpus)))
    if sharers > 1:
        raw = environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        try:
            total = float(raw) if raw else XLA_DEFAULT_MEM_FRACTION
        except ValueError:
            raise ValueError(f"baton.launch: XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} is not a "
                             "number") from None
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{total / sharers:.4f}"
    return env
