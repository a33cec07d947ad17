"""The DLPack bridge between runtime values (lists of arrays) and host tensors.

Sending: each array is handed to C++ as is; ``jax.Array`` and numpy arrays export DLPack
(zero-copy for a single-device array; ``jax.Array.__dlpack__`` waits until it is computed).
numpy arrays of ml_dtypes' bfloat16 (no DLPack code) cross as their bits.

Receiving: C++ hands over numpy views of 64-byte aligned buffers; :func:`from_host` turns
them into ``jax.Array``s without copying where XLA accepts the pointer.
"""

from __future__ import annotations

from typing import Any


def to_host(value: Any) -> list:
    """A runtime value as a list of arrays (a single array becomes a one-element list)."""
    arrays = list(value) if isinstance(value, (list, tuple)) else [value]
    for x in arrays:
        # A jax.Array must be computed before another stream (NCCL) reads it;
        # on CPU, DLPack export waits anyway. Runs on a transport thread.
        ready = getattr(x, "block_until_ready", None)
        if ready is not None:
            ready()
    return arrays


def from_host(arrays: list) -> list:
    """numpy arrays (64-byte aligned) -> ``jax.Array``s, zero-copy where possible."""
    import jax
    import jax.numpy as jnp

    out = []
    for a in arrays:
        try:
            out.append(jax.dlpack.from_dlpack(a, copy=False))
        except Exception:  # dtype without DLPack code (bfloat16 in numpy) or unaligned
            out.append(jnp.asarray(a))
    return out
