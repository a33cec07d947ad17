"""MaxText as a client of Baton (``baton.integrations.maxtext``): tiny MaxText models built by
MaxText's own config system, pipelined over 4 CPU devices with 1F1B and ZB-H1, trained for 5
steps; every loss within 1e-5 (relative) of MaxText's own, non-pipelined ``train_step`` on the
same batches, with the same optimizer (MaxText's AdamW and gradient clipping).

Needs MaxText, which lives in its own virtual environment (``bash scripts/setup_maxtext.sh``);
run with ``bash scripts/test.sh --maxtext`` or
``.venv-maxtext/bin/python -m pytest tests/python/test_maxtext.py``. The default test run does
not collect this file (``conftest.py``); named explicitly without MaxText it fails, naming the
install command.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton.integrations import maxtext as bmt  # noqa: E402

try:
    bmt.require_maxtext()
except ImportError as e:  # not a skip: this file is only run to test MaxText
    pytest.fail(str(e), pytrace=False)

STEPS = 5
MICROBATCHES = 4
BATCH = 8
RANKS = 4

# (config, MaxText's gradient_accumulation_steps for its own step): the dense Llama against
# MaxText's full-batch step, the MoE against MaxText's own accumulation over the same
# microbatches (both must agree with the pipeline; see the module docstring of the
# integration).
CASES = {"llama2": 1, "mixtral": MICROBATCHES}


@pytest.fixture(scope="module", params=sorted(CASES))
def reference(request):
    """The model, the batches, and MaxText's own losses and final parameters."""
    name = request.param
    m = bmt.build(name, batch=BATCH)
    step = m.reference_step(grad_accum=CASES[name])
    state = m.reference_state()
    batches = [m.make_batch(seed) for seed in range(STEPS)]
    losses = []
    for b in batches:
        state, loss = step(state, b)
        losses.append(float(loss))
    return m, batches, losses, m.reference_params(state)


@pytest.mark.parametrize("schedule", [baton.OneFOneB(), baton.ZBH1()], ids=str)
def test_pipelined_maxtext_matches_maxtexts_own_step(reference, schedule):
    m, batches, want, want_params = reference
    assert len(jax.devices()) >= RANKS
    step = m.pipeline_step(bmt.pipeline_mesh(m, RANKS), schedule, microbatches=MICROBATCHES)
    assert step.compile(m.init_params(), m.init_opt_state(), batches[0]).traced.num_stages == 4
    params, opt_state = m.init_params(), m.init_opt_state()
    got = []
    for b in batches:
        params, opt_state, loss = step(params, opt_state, b)
        got.append(float(loss))
    print(f"{m.config.model_name} {schedule}: baton {got}\n  maxtext {want}")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
    # Parameters after 5 AdamW steps (lr 1e-3): Adam divides by sqrt(v), so rounding-level
    # differences of tiny gradients move a weight by a small fraction of one step.
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)


def test_layers_are_cut_into_stages_without_changing_maxtext():
    m = bmt.build("llama2", batch=BATCH)
    assert bmt.split_layers(4, 4) == [[0], [1], [2], [3]]
    assert bmt.split_layers(6, 4) == [[0, 1], [2, 3], [4], [5]]
    m.staged_model(4)
    # the reference model is untouched
    assert [type(getattr(m.model.decoder, f"layers_{i}")).__name__ for i in range(4)] == \
        ["LlamaDecoderLayer"] * 4
    with pytest.raises(baton.ConfigError, match="cannot cut 4 decoder layers into 5 stages"):
        m.staged_model(5)
    with pytest.raises(baton.ConfigError, match="load_balance_loss_weight"):
        bmt.build("mixtral", batch=BATCH, load_balance_loss_weight=0.01)
