"""A closed-form fake pipeline model for runtime tests (the same one the C++ runtime tests use).

Per microbatch m: stage 0's forward reads 1 + m, each forward adds 1 (act = in + 1, stash = in);
the last stage's backward starts from gradient 1 and every backward doubles it (grad = 2 g);
the weight gradient is stash * g (B), or I keeps stash * g as wstash and W passes it on. So the
accumulated weight gradient of stage s over one step is sum_m (1 + m + s) * 2 ** (S - 1 - s).

Worker scripts of multi-process tests import this module too: they put this directory on
sys.path (see ``worker_prelude``).
"""

from __future__ import annotations

import pathlib

from baton import _core

K = _core.BufKind
HERE = pathlib.Path(__file__).resolve().parent


def apply_action(core, rank, action, env, const=float):
    """Runs action ``action`` of ``rank`` on ``env`` (buffer id -> number-like value), adding
    its outputs to ``env``. ``const`` builds the two source values (1 + m and the seed 1)."""
    S = core.schedule.num_stages

    def bid(kind, s, m):
        return core.buffer_id(_core.BufferKey(kind, s, m))

    act = core.schedule.rank_actions[rank][action]
    for t in [act.first] + ([act.second] if act.is_fused else []):
        s, m, kind = t.stage, t.microbatch, t.kind
        if kind == _core.TaskKind.F:
            x = const(1.0 + m) if s == 0 else env[bid(K.Act, s - 1, m)]
            if s < S - 1:
                env[bid(K.Act, s, m)] = x + 1
            env[bid(K.Stash, s, m)] = x
        elif kind == _core.TaskKind.W:
            env[bid(K.WGrad, s, m)] = env[bid(K.WStash, s, m)]
        else:
            g = const(1.0) if s == S - 1 else env[bid(K.Grad, s + 1, m)]
            if s > 0:
                env[bid(K.Grad, s, m)] = 2 * g
            out = K.WGrad if kind == _core.TaskKind.B else K.WStash
            env[bid(out, s, m)] = env[bid(K.Stash, s, m)] * g
    return env


def expected_accumulator(num_stages, num_microbatches, stage, steps=1):
    """Stage ``stage``'s accumulated weight gradient after ``steps`` steps."""
    return steps * sum((1.0 + m + stage) * 2.0 ** (num_stages - 1 - stage)
                       for m in range(num_microbatches))


def worker_prelude() -> str:
    """First line of a worker script: makes this module importable there."""
    return f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
