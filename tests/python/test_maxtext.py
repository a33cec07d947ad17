"""MaxText as a client of Baton (``baton.integrations.maxtext``): tiny MaxText models built by
MaxText's own config system at its defaults (``scan_layers=True``, ``remat_policy='full'``),
pipelined over 4 CPU devices with 1F1B and ZB-H1, trained for 5 steps; every loss within 1e-5
(relative) of MaxText's own, non-pipelined ``train_step`` on the same batches, with the same
optimizer (MaxText's AdamW and gradient clipping). The Mixtral case trains with MaxText's MoE
load-balance loss (sown inside the scanned layers, read in the loss on the last stage), and so
does the DeepSeek-V2 case, whose dense and MoE layers are two scanned stacks; one case keeps
``scan_layers=False`` (one module per layer). One test runs the Mixtral on 2 ranks of 2 devices
with MaxText's ``expert`` axis (``ici_expert_parallelism=2``) inside each stage,
against MaxText's own step on the same 4 devices. ``test_gradients_are_maxtexts`` compares the
gradients themselves, without an optimizer or clipping that could hide a scale error (one
step of unclipped SGD: each parameter changes by lr x its gradient), for the Llama and the
Mixtral under both schedules.

.ci/run runs this file twice: at the tests' -O0 (every case) and at XLA's default
optimizations less the cases marked ``heavy`` (the gradient comparison runs in both).

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

# id -> (config, overrides, MaxText's gradient_accumulation_steps for its own step): the dense
# Llama against MaxText's full-batch step, the MoE against MaxText's own accumulation over the
# same microbatches (both must agree with the pipeline; see the module docstring of the
# integration).
CASES = {
    "llama2": ("llama2", {}, 1),
    # MaxText's SGD here: Adam moves a weight whose gradient is at rounding level by up to a
    # whole step in either direction, so only SGD's updates (lr x clipped gradient) show
    # whether the load-balance loss's gradient reaches every stage's router
    "mixtral-lb": ("mixtral", {"load_balance_loss_weight": 0.1, "opt_type": "sgd",
                               "learning_rate": 0.1}, MICROBATCHES),
    "llama2-unscanned": ("llama2", {"scan_layers": False}, 1),
    # DeepSeek's two scanned stacks (1 dense layer, then 4 MoE layers), the same SGD and loss
    "deepseek2-lb": ("deepseek2", {"load_balance_loss_weight": 0.1, "opt_type": "sgd",
                                   "learning_rate": 0.1}, MICROBATCHES),
}


# The cases .ci/run leaves out of its pass at XLA's default optimizations (`heavy`; the -O0
# pass runs them): the MoE models' 5 steps (their gradients at XLA's defaults:
# test_gradients_are_maxtexts).
HEAVY_CASES = {"mixtral-lb", "deepseek2-lb"}


def _case_params(names, heavy):
    return [pytest.param(n, marks=pytest.mark.heavy) if n in heavy else n for n in names]


@pytest.fixture(scope="module", params=_case_params(sorted(CASES), HEAVY_CASES))
def reference(request):
    """The model, the batches, and MaxText's own losses and final parameters."""
    name, overrides, ga = CASES[request.param]
    m = bmt.build(name, batch=BATCH, **overrides)
    step = m.reference_step(grad_accum=ga)
    state = m.reference_state()
    batches = [m.make_batch(seed) for seed in range(STEPS)]
    losses = []
    for b in batches:
        state, loss = step(state, b)
        losses.append(float(loss))
    return m, batches, losses, m.reference_params(state)


def _check_sgd_updates(m, params, want_params):
    """Under SGD the parameter change is lr x the accumulated (clipped) gradients: each
    leaf's change within 1e-3 of its largest entry (rounding of sums in another order)."""
    init = m.init_params()
    for a, b, p0 in zip(jax.tree.leaves(params), jax.tree.leaves(want_params),
                        jax.tree.leaves(init), strict=True):
        got, want = np.asarray(a) - np.asarray(p0), np.asarray(b) - np.asarray(p0)
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max() + 1e-7)


@pytest.mark.parametrize("schedule", [baton.OneFOneB(), baton.ZBH1()], ids=str)
def test_pipelined_maxtext_matches_maxtexts_own_step(reference, schedule):
    m, batches, want, want_params = reference
    assert len(jax.devices()) >= RANKS
    # scanned stacks: split per stage under 1F1B (each rank holds its layers), whole under ZB-H1
    split = m.config.scan_layers and isinstance(schedule, baton.OneFOneB)
    params = m.init_params(stages=RANKS) if split else m.init_params()
    opt_state = m.init_opt_state(params)
    step = m.pipeline_step(bmt.pipeline_mesh(m, RANKS), schedule, microbatches=MICROBATCHES)
    assert step.compile(params, opt_state, batches[0]).traced.num_stages == 4
    got = []
    for b in batches:
        params, opt_state, loss = step(params, opt_state, b)
        got.append(float(loss))
    print(f"{m.config.model_name} scan_layers={m.config.scan_layers} {schedule}: baton {got}\n"
          f"  maxtext {want}")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
    if split:  # each stage's rows of the stack (and of Adam's moments) stay on its rank
        last = step.last
        stacks = [x for x in jax.tree.leaves((params, opt_state), is_leaf=lambda x: isinstance(
            x, baton.Stacked)) if isinstance(x, baton.Stacked)]
        assert stacks
        for x in stacks:
            for g, piece in enumerate(x.pieces):
                assert piece.sharding.device_set == set(last.mesh.rank_devices[last.stage_rank[g]])
    # Parameters after 5 AdamW steps (lr 1e-3): Adam divides by sqrt(v), so rounding-level
    # differences of tiny gradients move a weight by a small fraction of one step.
    params = baton.join_stacks(params)
    assert jax.tree.structure(params) == jax.tree.structure(want_params)
    if m.config.opt_type == "sgd":
        _check_sgd_updates(m, params, want_params)
        return
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)


# The gradient comparison: one step of MaxText's SGD (``optax.sgd``: no momentum, no weight
# decay) with its gradient clipping off (``gradient_clipping_threshold=0``: MaxText's
# ``train_step`` then applies its raw gradients), so each parameter changes by exactly
# -lr x its gradient, in the pipelined step and in MaxText's own; lr (1e3, MaxText's cosine
# schedule starts at it) makes that change dwarf the rounding of the parameters themselves.
GRAD_LR = 1e3
GRAD_CASES = {
    # the dense Llama against MaxText's full-batch gradient (no accumulation)
    "llama2": ("llama2", {}, 1),
    # the MoE with the load-balance loss against MaxText's accumulation over the microbatches
    "mixtral-lb": ("mixtral", {"load_balance_loss_weight": 0.1}, MICROBATCHES),
}
GRAD_RTOL = 1e-4


def _gradient_error(got, want) -> float:
    """||got - want|| / ||want|| of one leaf."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _check_gradients(m, params, want_params, lr):
    """The pipelined step's gradients are MaxText's: after one step of unclipped SGD from the
    same parameters, each leaf's change / -lr (its gradient) within GRAD_RTOL of MaxText's,
    relative in norm. Any gradient scaled by a factor c is off by |c - 1| in that norm on every
    leaf: summed instead of averaged over the microbatches (c = 4 here), averaged twice
    (c = 1/4), or doubled (c = 2) all fail by more than 1000x the tolerance, where the
    pipelined and MaxText's gradients differ by summation order only (worst leaf 8e-7 at
    XLA's defaults). Tried with the step's objective doubled, multiplied by 4, and its
    gradients averaged instead of summed over the microbatches, the reported loss left as it
    was: every leaf failed, by 1.0, 3.0 and 0.75, while the losses still agreed."""
    init = m.init_params()
    errs = {}
    for (path, a), b, p0 in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree.leaves(want_params), jax.tree.leaves(init),
                                strict=True):
        got = -(np.asarray(a, np.float64) - np.asarray(p0, np.float64)) / lr
        want = -(np.asarray(b, np.float64) - np.asarray(p0, np.float64)) / lr
        assert np.abs(want).max() > 0, jax.tree_util.keystr(path)
        errs[jax.tree_util.keystr(path)] = _gradient_error(got, want)
    worst = max(errs, key=errs.get)
    print(f"worst gradient error {errs[worst]:.2e} ({worst}) over {len(errs)} leaves")
    bad = {k: v for k, v in errs.items() if not v <= GRAD_RTOL}
    assert not bad, f"gradients differ from MaxText's (relative, in norm): {bad}"


@pytest.mark.parametrize("case,schedule", [
    ("llama2", baton.OneFOneB()), ("llama2", baton.ZBH1()), ("mixtral-lb", baton.OneFOneB()),
    pytest.param("mixtral-lb", baton.ZBH1(), marks=pytest.mark.heavy),
], ids=lambda x: str(x))
def test_gradients_are_maxtexts(case, schedule):
    """The accumulated gradients of the pipelined step are MaxText's own step's, compared
    directly (no Adam, no clipping between them and the parameters: see GRAD_LR and
    ``_check_gradients``), at 4 microbatches over 4 ranks; .ci/run runs this file at XLA's
    default optimizations as well as at the tests' -O0."""
    name, overrides, ga = GRAD_CASES[case]
    m = bmt.build(name, batch=BATCH, opt_type="sgd", learning_rate=GRAD_LR,
                  gradient_clipping_threshold=0, **overrides)
    lr = float(m.lr_schedule(0))
    assert lr == GRAD_LR
    batch = m.make_batch(0)
    state, want = m.reference_step(grad_accum=ga)(m.reference_state(), batch)
    want_params = m.reference_params(state)

    split = isinstance(schedule, baton.OneFOneB)  # the stack per stage, as above
    params = m.init_params(stages=RANKS) if split else m.init_params()
    step = m.pipeline_step(bmt.pipeline_mesh(m, RANKS), schedule, microbatches=MICROBATCHES)
    params, _, loss = step(params, m.init_opt_state(params), batch)
    print(f"{case} {schedule}: loss baton {float(loss)} maxtext {float(want)}")
    _check_gradients(m, baton.join_stacks(params), want_params, lr)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=0)


@pytest.mark.heavy  # interpreted ranks of 2 devices; the MoE's gradients: above
def test_mixtral_experts_sharded_over_maxtexts_expert_axis_inside_stages():
    """MaxText's expert axis inside each pipeline stage: the tiny Mixtral (scan_layers=True,
    load-balance loss, SGD as in "mixtral-lb") with ``ici_expert_parallelism=2``, 2 ranks of 2
    devices (``expert=2``), 1F1B, against MaxText's own step with gradient accumulation over
    the same microbatches on the same 4 devices (MaxText's mesh there: ``expert=2`` and
    ``fsdp=2``). The experts stay split over the expert axis on each rank: each device holds
    half of them. Ranks of several devices in one process run on the interpreter
    (``single_program=False``: XLA:CPU runs one multi-device program at a time)."""
    batch, ranks = 16, 2  # microbatches of 4 rows: split over MaxText's batch axes everywhere
    m = bmt.build("mixtral", batch=batch, ici_expert_parallelism=2,
                  **CASES["mixtral-lb"][1])
    assert m.config.scan_layers and len(m.devices) == 2 and m.mesh.shape["expert"] == 2
    devices = jax.devices()[:ranks * 2]
    ref = m.reference_step(grad_accum=MICROBATCHES, devices=devices)
    state = m.reference_state(devices=devices)
    batches = [m.make_batch(seed) for seed in range(STEPS)]
    want = []
    for b in batches:
        state, loss = ref(state, b)
        want.append(float(loss))
    want_params = m.reference_params(state)
    assert want_params["decoder"]["layers"]["MoeBlock_0"]["wi_0"].sharding.spec[0] == "expert"

    mesh = bmt.pipeline_mesh(m, ranks)
    assert mesh.devices_per_rank() == 2 and mesh.axis_size("expert") == 2
    params = m.init_params(stages=ranks)
    opt_state = m.init_opt_state(params)
    step = m.pipeline_step(mesh, baton.OneFOneB(), microbatches=MICROBATCHES,
                           single_program=False)
    got = []
    for b in batches:
        params, opt_state, loss = step(params, opt_state, b)
        got.append(float(loss))
    print(f"mixtral expert=2 x 2 ranks: baton {got}\n  maxtext {want}")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
    last = step.last
    assert last.traced.num_stages == ranks
    experts = m.config.num_experts
    for name in ("wi_0", "wi_1", "wo"):
        stacked = params["decoder"]["layers"]["MoeBlock_0"][name]
        for g, piece in enumerate(stacked.pieces):
            assert piece.sharding.spec[0] == "expert", (name, piece.sharding)
            assert piece.sharding.device_set == set(mesh.rank_devices[last.stage_rank[g]])
            shards = piece.addressable_shards
            assert len(shards) == 2 and all(s.data.shape[0] == experts // 2 for s in shards)
    _check_sgd_updates(m, baton.join_stacks(params), want_params)


def test_expert_count_must_divide_the_expert_axis():
    with pytest.raises(baton.ConfigError,
                       match="num_experts=3 is not divisible by ici_expert_parallelism=2"):
        bmt.build("mixtral", batch=BATCH, num_experts=3, ici_expert_parallelism=2)


def _scan_lengths(jaxpr) -> list[int]:
    """The lengths of the scans in ``jaxpr`` outside other scans, in program order."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out.append(int(eqn.params["length"]))
            continue
        for v in eqn.params.values():
            for x in v if isinstance(v, (tuple, list)) else [v]:
                sub = x if hasattr(x, "eqns") else getattr(x, "jaxpr", None)
                if hasattr(sub, "eqns"):
                    out += _scan_lengths(sub)
    return out


@pytest.mark.heavy  # the staged loss runs in every pipelined case above
def test_scanned_stack_stays_a_scan_per_stage():
    """8 scanned layers in 3 stages: the staged model runs 3 scans of 3, 3 and 2 layers
    (compile time does not grow with the layer count), and its loss is MaxText's."""
    m = bmt.build("llama2", batch=BATCH, base_num_decoder_layers=8)
    assert m.config.scan_layers and m.num_layers == 8
    params, mb = m.init_params(), m.make_batch(0)
    tokens = np.float32(np.sum(mb["targets_segmentation"] != 0))
    whole = m.microbatch_loss(1, 1)
    staged = m.microbatch_loss(3, 1)
    assert _scan_lengths(jax.make_jaxpr(whole)(params, tokens, mb).jaxpr) == [8]
    assert _scan_lengths(jax.make_jaxpr(staged)(params, tokens, mb).jaxpr) == [3, 3, 2]
    np.testing.assert_allclose(staged(params, tokens, mb)[0], whole(params, tokens, mb)[0],
                               rtol=1e-6)
    # the reference model is untouched
    assert type(m.model.decoder).__name__ == "NNXDecoder"
    with pytest.raises(baton.ConfigError, match="cannot cut 8 decoder layers into 9 stages"):
        m.staged_model(9)


@pytest.mark.heavy  # DeepSeek's stacks: the -O0 pass (its pipelined case is heavy too)
def test_deepseek_stacks_are_cut_in_order_across_stages():
    """DeepSeek's dense and MoE stacks (2 + 3 layers) in 3 stages: the stages take 2, 2 and 1
    layers, so a stage ends where the dense stack does; each stage's part of a stack is one
    scan, and the loss (with the load-balance loss sown in the MoE layers of every stage)
    is MaxText's."""
    m = bmt.build("deepseek2", batch=BATCH, base_num_decoder_layers=5, first_num_dense_layers=2,
                  load_balance_loss_weight=0.1)
    assert m.num_layers == 5
    stacks = bmt.scanned_stacks(m.config)
    assert stacks == [("dense_layers", 2), ("moe_layers", 3)]
    assert bmt.stack_pieces(stacks, 3) == {"dense_layers": [(0, 0, 2)],
                                           "moe_layers": [(1, 0, 2), (2, 2, 3)]}
    params, mb = m.init_params(), m.make_batch(0)
    tokens = np.float32(np.sum(mb["targets_segmentation"] != 0))
    whole, staged = m.microbatch_loss(1, 1), m.microbatch_loss(3, 1)
    assert _scan_lengths(jax.make_jaxpr(whole)(params, tokens, mb).jaxpr) == [2, 3]
    assert _scan_lengths(jax.make_jaxpr(staged)(params, tokens, mb).jaxpr) == [2, 2, 1]
    np.testing.assert_allclose(staged(params, tokens, mb)[0], whole(params, tokens, mb)[0],
                               rtol=1e-6)
    split = m.init_params(stages=3)["decoder"]
    assert not isinstance(split["dense_layers"]["mlp"]["wi_0"]["kernel"], baton.Stacked)
    assert split["moe_layers"]["DeepSeekMoeBlock_0"]["shared_experts"]["wi_0"]["kernel"].sizes \
        == [2, 1]
    with pytest.raises(baton.ConfigError, match="cannot cut 5 scanned decoder layers into 6"):
        m.init_params(stages=6)
    with pytest.raises(baton.ConfigError, match="use_batch_split_schedule"):
        bmt.scanned_stacks(bmt.load_config("deepseek2", batch=BATCH,
                                           use_batch_split_schedule=True))


def test_layers_are_cut_into_stages_without_changing_maxtext():
    m = bmt.build("llama2", batch=BATCH, scan_layers=False)
    assert bmt.split_layers(4, 4) == [[0], [1], [2], [3]]
    assert bmt.split_layers(6, 4) == [[0, 1], [2, 3], [4], [5]]
    m.staged_model(4)
    # the reference model is untouched
    assert [type(getattr(m.model.decoder, f"layers_{i}")).__name__ for i in range(4)] == \
        ["LlamaDecoderLayer"] * 4
    with pytest.raises(baton.ConfigError, match="cannot cut 4 decoder layers into 5 stages"):
        m.staged_model(5)
    with pytest.raises(baton.ConfigError, match="load_balance_loss_weight"):
        bmt.build("mixtral", batch=BATCH, load_balance_loss_weight=0.01, scan_layers=False)
