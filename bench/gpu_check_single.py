"""Single-GPU checks of the CUDA path (run by bench/gpu_check.sh on a machine with a GPU).

Prints one line per check, ``ROW <name>|<PASS|FAIL|INFO>|<detail>``; a check that cannot run
what it claims prints FAIL with the reason. Checks:

* self link (FFI, fori_loop): a rank sending to itself through the CUDA FFI handlers and
  ``NcclRankComm`` (a 1-rank NCCL communicator) inside a jitted ``fori_loop``: results exact,
  staging slots and CUDA events the same after step 1 as after step 10 (``reserve`` made them
  before step 1), time per unit (one send + post + wait and an add);
* peer never arrives: a context whose peer (rank 1) never comes raises within the setup
  timeout, naming the peer; afterwards the CUDA context still computes, and a new context
  works;
* implicit sync probe: how long a cudaMalloc (``reserve`` of a new size) takes on the host
  while the GPU is busy (INFO: a call as long as the busy work means the allocation waited
  for the device, which is why the staging pool is reserved before the first step);
* switch vs straight (INFO): time per unit of a loop of ``lax.switch`` units (the table form)
  and of the same units straight (the form GPU ranks get), results equal;
* one libnccl mapped: after all of this, exactly one ``libnccl`` is mapped in the process and
  it is the one Baton uses.
"""

from __future__ import annotations

import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np


def row(name: str, status: str, detail: str) -> None:
    print(f"ROW {name}|{status}|{detail}", flush=True)


def self_link(rt, ffi) -> None:
    name = "self link (FFI, fori_loop)"
    n = 1 << 20  # 4 MiB of float32 per transfer
    store = rt.file_store(tempfile.mkdtemp())
    c = rt.NcclRankComm(0, 1, 0, store, [(0, 0, True), (0, 0, False)], 60.0, "check/self")
    c.set_layout(0, 0, [n * 4])
    c.reserve([(0, 0, True, 1), (0, 0, False, 1)])
    ops = [(0, 0, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0)]  # send to self, post, wait
    out = jax.ShapeDtypeStruct((n,), jnp.float32)

    def body(_, carry):
        x, tok = carry
        tok, (y,) = ffi.comm(c.id, ops, tok, [x], [out])
        return y + 1.0, tok

    @jax.jit
    def steps(x, k):
        tok = jnp.zeros((), jnp.int32)
        x, tok = jax.lax.fori_loop(0, k, body, (x, tok))
        return x, ffi.drain(c.id, tok)

    x0 = jnp.arange(n, dtype=jnp.float32)
    y, _ = jax.block_until_ready(steps(x0, 1))
    after1 = (c.slots_allocated, c.events_created)
    k = 200
    jax.block_until_ready(steps(x0, k))
    t = time.perf_counter()
    y, _ = jax.block_until_ready(steps(x0, k))
    dt = (time.perf_counter() - t) / k
    want = np.arange(n, dtype=np.float32) + k
    exact = bool(np.array_equal(np.asarray(y), want))
    after = (c.slots_allocated, c.events_created)
    fail = c.failure()
    c.close()
    ok = exact and after == after1 and fail is None
    row(name, "PASS" if ok else "FAIL",
        f"exact {exact}; slots/events after step 1 {after1}, after {2 * k + 1} steps {after}; "
        f"{dt * 1e6:.1f} us per unit (4 MiB send+post+wait+add); failure {fail}")


def peer_never_arrives(rt, errors) -> None:
    name = "peer never arrives"
    store = rt.file_store(tempfile.mkdtemp())
    limit = 5.0
    t = time.perf_counter()
    try:
        rt.NcclRankComm(0, 2, 0, store, [(1, 0, True)], limit, "check/lonely",
                        setup_timeout=limit)
        row(name, "FAIL", "constructing a context whose peer never comes returned")
        return
    except errors as e:
        dt = time.perf_counter() - t
        msg = str(e)
    named = "rank 1" in msg or "peer rank 1" in msg or "1->" in msg or "0->1" in msg
    # the CUDA context still works: a computation and a new (self-link) context
    x = jnp.ones((1024,), jnp.float32)
    usable = float(jax.block_until_ready(jnp.sum(x * 2))) == 2048.0
    c = rt.NcclRankComm(0, 1, 0, rt.file_store(tempfile.mkdtemp()), [(0, 0, True), (0, 0, False)],
                        30.0, "check/after")
    alive = c.alive
    c.close()
    ok = dt < limit + 10 and named and usable and alive
    row(name, "PASS" if ok else "FAIL",
        f"raised after {dt:.1f} s (limit {limit:g} s), names the peer {named}, CUDA usable "
        f"after {usable}, new context alive {alive}: {msg[:160]}")


def implicit_sync_probe(rt) -> None:
    name = "implicit sync probe"
    store = rt.file_store(tempfile.mkdtemp())
    c = rt.NcclRankComm(0, 1, 0, store, [(0, 0, True), (0, 0, False)], 60.0, "check/probe")
    a = jnp.ones((8192, 8192), jnp.float32)

    @jax.jit
    def busy(a):
        return jax.lax.fori_loop(0, 40, lambda _, x: jnp.tanh(x @ a) * 0.5, a)

    jax.block_until_ready(busy(a))
    t = time.perf_counter()
    jax.block_until_ready(busy(a))
    work = time.perf_counter() - t
    r = busy(a)  # in flight
    t = time.perf_counter()
    c.set_layout(0, 1, [256 << 20])
    c.reserve([(0, 1, True, 1)])  # one cudaMalloc of 256 MiB while the GPU is busy
    call = time.perf_counter() - t
    jax.block_until_ready(r)
    c.close()
    waited = call > 0.5 * work
    row(name, "INFO", f"cudaMalloc while the GPU is busy took {call * 1e3:.1f} ms (busy work "
        f"{work * 1e3:.0f} ms): {'waited for the device' if waited else 'did not wait'}; "
        "staging is reserved before the first step either way")


def switch_cost() -> None:
    """Time per unit of a loop whose 8 units are each a two-branch ``lax.switch`` (the table
    form) against the same units straight (the GPU form): XLA's GPU conditional thunk copies
    the branch index to the host and waits for it before each branch."""
    name = "switch vs straight"
    x0 = jnp.ones((256, 256), jnp.float32)
    units = 8

    def unit(x):
        return jnp.tanh(x @ x) * 0.5

    def body_switch(i, x):
        for _ in range(units):
            x = jax.lax.switch((i >= 0).astype(jnp.int32), [lambda y: y, unit], x)
        return x

    def body_straight(_, x):
        for _ in range(units):
            x = unit(x)
        return x

    times = {}
    for label, body in (("switch", body_switch), ("straight", body_straight)):
        f = jax.jit(lambda x, k, body=body: jax.lax.fori_loop(0, k, body, x))
        jax.block_until_ready(f(x0, 2))
        t = time.perf_counter()
        y = jax.block_until_ready(f(x0, 200))
        times[label] = (time.perf_counter() - t) / (200 * units)
        times[label + "_y"] = np.asarray(y)
    same = bool(np.allclose(times["switch_y"], times["straight_y"]))
    row(name, "INFO" if same else "FAIL",
        f"per unit: switch {times['switch'] * 1e6:.1f} us, straight "
        f"{times['straight'] * 1e6:.1f} us (256x256 matmul+tanh); results equal {same}")


def one_libnccl(rt) -> None:
    name = "one libnccl mapped"
    path, version, was_mapped, err = rt.nccl_library()  # (loads it if nothing did yet)
    mapped = rt.mapped_libraries("libnccl")
    real = {__import__("os").path.realpath(p) for p in mapped}
    ok = len(real) == 1 and not err and __import__("os").path.realpath(path) in real
    row(name, "PASS" if ok else "FAIL",
        f"mapped {mapped}; Baton uses {path} (NCCL code {version}, "
        f"{'JAX' if was_mapped else 'Baton'} loaded it){'; error ' + err if err else ''}")


def main() -> None:
    from baton import _core
    from baton.errors import BatonError
    from baton.emit import ffi

    rt = _core.runtime
    assert jax.default_backend() == "gpu", f"backend {jax.default_backend()}, not gpu"
    assert _core.ffi.has_cuda(), "baton._core was built without the CUDA handlers"
    jax.block_until_ready(jnp.zeros(1))  # the GPU backend (and JAX's NCCL) is up first
    ffi.register()
    for check in (lambda: self_link(rt, ffi), lambda: peer_never_arrives(rt, (BatonError,
                                                                               RuntimeError)),
                  lambda: implicit_sync_probe(rt), switch_cost, lambda: one_libnccl(rt)):
        try:
            check()
        except Exception:  # noqa: BLE001  (the row says what failed)
            traceback.print_exc()


if __name__ == "__main__":
    main()
