"""The start-up handshake over the whole traced program (``running/handshake.py``).

One launch of 2 processes (one pipeline rank each, Gloo) builds a series of steps in which
process 1 runs different code than process 0: a different layer width, a different
activation function, a different schedule, a different microbatch count, and a model that
fails to trace. Each is refused in both processes with a ``ConfigError`` that names the
differing component, both values and the processes; the failing trace is re-raised in its
own process and named in the other. Control: the same code in both processes is accepted
and trains one step; the same code with ``jax.nn.relu`` (a ``custom_jvp`` whose parameters
print function objects) is accepted. The refusals leave the process group usable (the
cases run in order in one launch). Unit tests of the text cleaning run in this process.
"""

from __future__ import annotations

import json
import os
import pathlib

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton.running import handshake  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def make_step(act=jnp.tanh, boundary=True):
    def loss_fn(params, batch):
        x, y = batch
        h = act(x @ params[0])
        if boundary:
            h = baton.stage_boundary(h)
        h = act(h @ params[1])
        return jnp.mean((h - y) ** 2)

    def step(params, batch):
        loss, grads = baton.accumulate(jax.value_and_grad(loss_fn), params, batch=batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    return step


def args(width=16, batch=8):
    k = jax.random.PRNGKey(0)
    params = [jax.random.normal(k, (16, width)) * 0.1, jax.random.normal(k, (width, 16)) * 0.1]
    return params, (jnp.ones((batch, 16)), jnp.zeros((batch, 16)))


# case -> (process 0's (step kwargs, arg kwargs, jit kwargs), process 1's)
SAME = ({}, {}, {})
CASES = {
    "width": (SAME, ({}, {"width": 32}, {})),
    "activation": (SAME, ({"act": jax.nn.relu}, {}, {})),
    "schedule": (SAME, ({}, {}, {"schedule": baton.GPipe()})),
    "microbatches": (SAME, ({}, {}, {"microbatches": 4})),
    "trace-error": (SAME, ({"boundary": False}, {}, {})),
    "same": (SAME, SAME),
    # the same code with a custom_jvp (its parameters print function objects)
    "same-relu": (({"act": jax.nn.relu}, {}, {}), ({"act": jax.nn.relu}, {}, {})),
}


def worker_main(out: str) -> None:
    p = int(os.environ["BATON_RANK"])
    res = {}
    for name, sides in CASES.items():
        step_kw, arg_kw, jit_kw = sides[p]
        jit_kw = {"schedule": baton.OneFOneB(), "microbatches": 2, "timeout": 60, **jit_kw}
        fn = baton.jit(make_step(**step_kw), **jit_kw)
        try:
            if name != "same":
                fn.compile(*args(**arg_kw))
                res[name] = ["ok", 0.0]
                continue
            _, loss = fn(*args(**arg_kw))
            res[name] = ["ok", float(jax.device_get(fn.gather(loss)))
                         if hasattr(fn, "gather") else 0.0]
        except baton.BatonError as e:
            res[name] = [type(e).__name__, str(e)]
    pathlib.Path(out, f"process{p}.json").write_text(json.dumps(res))


WORKER = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import test_program_handshake as T
T.worker_main(sys.argv[1])
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from launched import run_workers

    return run_workers(tmp_path_factory.mktemp("handshake"), WORKER)


def both(results, name):
    return results[0][name], results[1][name]


@pytest.mark.parametrize("name", ["same", "same-relu"])
def test_same_program_is_accepted(results, name):
    a, b = both(results, name)
    assert a[0] == b[0] == "ok", (a, b)
    if name == "same":  # one step trained after the handshake, the loss on both
        assert a[1] == b[1] and a[1] > 0, (a, b)


@pytest.mark.parametrize("name, component, values", [
    ("width", "inputs differs", ["f32[16,16]", "f32[16,32]"]),
    ("activation", "stage 0 forward differs", ["tanh", "max"]),
    ("schedule", "schedule differs", ["OneFOneB()", "GPipe()"]),
    ("microbatches", "microbatches differs", ["process 0 has '2'", "process 1 has '4'"]),
])
def test_different_programs_are_refused_by_name(results, name, component, values):
    for side in both(results, name):
        kind, msg = side
        assert kind == "ConfigError", side
        assert "the processes traced different programs" in msg, msg
        assert component in msg, msg
        assert "process 0 has" in msg and "process 1 has" in msg, msg
        for v in values:
            assert v in msg, msg


def test_a_process_that_cannot_trace_is_named_by_the_others(results):
    a, b = both(results, "trace-error")
    assert a[0] == "ConfigError" and "process 1 could not build it (TraceError" in a[1], a
    assert b[0] == "TraceError" and "stage_boundary" in b[1], b


def test_clean_removes_addresses_and_device_ids_and_sorts_sets():
    a = handshake._clean("f=<function g at 0x7f00aa> s=frozenset({'b', 'a'})")
    b = handshake._clean("f=<function g at 0x7f11bb> s=frozenset({'a', 'b'})")
    assert a == b == "f=<function g> s=frozenset({'a', 'b'})"
    assert handshake._clean("devices=[CpuDevice(id=3)]") == handshake._clean(
        "devices=[CpuDevice(id=0)]") == "devices=[Device]"


def test_first_line_diff_names_the_line():
    assert handshake._first_line_diff(["x", "y"], ["x", "z"]) == (1, "y", "z")
    assert handshake._first_line_diff(["x"], ["x", "z"]) == (1, "(nothing)", "z")
    assert handshake._first_line_diff(["x"], ["x"])[0] == -1
