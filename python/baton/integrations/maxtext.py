"""MaxText as a client of Baton: a MaxText model, built by MaxText's own config system, cut
into pipeline stages without editing MaxText, and trained with ``baton.jit``.

```python
from baton.integrations import maxtext as bmt

m = bmt.build("llama2", batch=16)                 # MaxText's pyconfig + its NNX Transformer
mesh = bmt.pipeline_mesh(m, ranks=4)              # 4 CPU devices, one per pipeline rank
step = m.pipeline_step(mesh, baton.ZBH1(), microbatches=4)
params, opt_state = m.init_params(), m.init_opt_state()
params, opt_state, loss = step(params, opt_state, m.make_batch(0))

ref = m.reference_step()                          # MaxText's own train_step (not pipelined)
state, ref_loss = ref(m.reference_state(), m.make_batch(0))
```

**Stages.** MaxText 0.2.5 is Flax NNX. At its default ``scan_layers=True`` the decoder keeps its
layers as a stacked module (DeepSeek's: two) and runs each as one ``jax.lax.scan`` under
``jax.checkpoint`` (MaxText's ``remat_policy``); a copy of the model gets a decoder subclass
that runs those scans once per stage group, on the group's rows of the stack, with
``baton.stage_boundary`` between groups (``maxtext_scan.py``): each stage's layers stay one
scan, so compile time does not grow with the layer count. With ``scan_layers=False``
``NNXDecoder.__call__`` loops over its layers ``layers_0 .. layers_{L-1}``; the layers that end
a stage get a subclass of their own class whose ``__call__`` passes the layer's output through
``baton.stage_boundary``. The marker sits at the end of the checkpointed layer; Baton's tracer
moves it out of the remat region (``tracing/trace.py``, ``emit_remat``), so MaxText's
rematerialization is kept. Either way MaxText's files and the reference model are not changed.
The embedding runs in the first stage, the final norm, the output head and the loss in the last.

**Loss.** Each microbatch runs MaxText's own ``loss_fn`` (``maxtext.trainers.pre_train.train``)
with ``gradient_accumulation_steps`` = microbatches, so it returns what MaxText's gradient
accumulation differentiates: the token-summed cross entropy over ``targets`` where
``targets_segmentation != 0`` (plus auxiliary losses scaled by the microbatch's token count).
The step divides by the token count of the whole batch, sums over microbatches, and reports
the loss as MaxText does (``xent / tokens + aux / microbatches``). This equals MaxText's
full-batch loss and gradient (``gradient_accumulation_steps=1``) for a dense model whatever the
padding, and MaxText's own gradient accumulation with as many microbatches in general: the
step splits the batch as MaxText does (row ``r`` in microbatch ``r mod M``), which matters for
per-microbatch terms such as the MoE load-balance loss.
Gradient clipping (``gradient_clipping_threshold``) and the optimizer
(``optimizers.get_optimizer``, AdamW by default) are MaxText's, applied to the same pytree
of parameters as MaxText's ``nnx.Optimizer``.

**Sown values.** With ``scan_layers=True`` the values MaxText sows inside its layers (the MoE
load-balance loss, ``load_balance_loss_weight > 0``) travel with the activations through the
stage boundaries to the loss (``maxtext_scan.py``). With ``scan_layers=False`` they would cross
stages without a boundary: refused with a ``ConfigError``.

**Parallelism inside stages.** MaxText's ``ici_*_parallelism`` shape each rank: with
``bmt.build("mixtral", batch=16, ici_expert_parallelism=2)`` the model is built on MaxText's
mesh of 2 devices (``maxtext_utils.get_mesh_from_config``: its ``mesh_axes``, ``expert=2``);
``pipeline_mesh(m, ranks=2)`` gives each rank a sub-mesh of that shape (4 devices in all); the
parameters are placed as MaxText's logical axis rules shard them (``param_shardings``: the
experts over ``expert``, ``embed`` dimensions over ``fsdp`` and ``expert``). Baton keeps those
shardings on every rank, splits each microbatch over the ``data``, ``fsdp`` and ``expert``
axes, and XLA partitions each stage's tasks over the rank's devices. ``reference_step`` and
``reference_state`` take ``devices=``: MaxText's own step on MaxText's mesh for them, jitted as
its trainer jits it (state and batch in MaxText's shardings). In one process on CPUs, ranks of
several devices run on the interpreter (``pipeline_step(..., single_program=False)``): the
compiled engine refuses them there, since XLA:CPU runs one multi-device program at a time. An
expert count that ``ici_expert_parallelism`` does not divide, and MaxText's own pipeline axis
(``ici_pipeline_parallelism > 1``), raise ``ConfigError``.

**Stacks.** The generic scanned stack (one layer per scan step), and DeepSeek's two stacks (its
first dense layers, then its MoE layers: ``bmt.build("deepseek2")``), cut in order across
stages. Decoder blocks that scan blocks of layers, and DeepSeek's engram, lineage and
batch-split variants, are refused. With
``init_params(stages=S)`` each rank holds only its stage's rows of the stacked parameters (and
their optimizer state); with the whole stack every stage reads its rows from it, so every rank
holds the whole stacked parameters.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import ConfigError
from .maxtext_config import (  # noqa: F401  (the integration's API)
    CONFIGS,
    INSTALL_HINT,
    LLAMA2_TINY,
    MAXTEXT_VERSION,
    MIXTRAL_TINY,
    check_expert_axis,
    load_config,
    mesh_of,
    rank_size,
    require_maxtext,
    synthetic_batch,
)
from .maxtext_scan import layer_axis_of, scanned_stacks, stack_pieces, staged_decoder_class

# --- stage boundaries ---------------------------------------------------------------

_STAGE_END: dict[type, type] = {}


def stage_end_class(base: type) -> type:
    """A subclass of the layer class ``base`` whose ``__call__`` ends a pipeline stage: the
    layer's output (the first element when it returns ``(output, kv_cache)``) goes through
    ``baton.stage_boundary``. One class per ``base``."""
    cls = _STAGE_END.get(base)
    if cls is None:
        from ..frontend import stage_boundary

        def __call__(self, *args, **kwargs):
            out = base.__call__(self, *args, **kwargs)
            if isinstance(out, tuple):
                return (stage_boundary(out[0]), *out[1:])
            return stage_boundary(out)

        cls = type(f"StageEnd{base.__name__}", (base,),
                   {"__call__": __call__, "__module__": __name__,
                    "__qualname__": f"StageEnd{base.__name__}"})
        _STAGE_END[base] = cls
    return cls


def split_layers(num_layers: int, stages: int) -> list[list[int]]:
    """Layer indices per stage: ``stages`` contiguous groups, sizes differing by at most one
    (the first stages get the extra layers)."""
    if not 1 <= stages <= num_layers:
        raise ConfigError(f"cannot cut {num_layers} decoder layers into {stages} stages "
                          f"(each stage needs a layer; raise base_num_decoder_layers)")
    return [list(map(int, g)) for g in np.array_split(np.arange(num_layers), stages)]


def _scanned_layer_count(model) -> int:
    """The layer count of MaxText's scanned decoder stacks (``scanned_stacks``: the generic
    ``decoder.layers``, or DeepSeek's dense and MoE stacks)."""
    stacks = scanned_stacks(model.config)
    missing = [a for a, _ in stacks if getattr(model.decoder, a, None) is None]
    if missing:
        raise ConfigError(f"baton.integrations.maxtext: MaxText's decoder "
                          f"({model.config.decoder_block}) has no scanned stack {missing[0]}; "
                          f"set scan_layers=False")
    return sum(k for _, k in stacks)


def _decoder_layers(model) -> list:
    dec = model.decoder
    n = model.config.num_decoder_layers
    layers = [getattr(dec, f"layers_{i}", None) for i in range(n)]
    if any(x is None for x in layers):
        raise ConfigError("baton.integrations.maxtext needs the decoder layers as separate "
                          "modules layers_0..layers_{L-1}: set scan_layers=False (and a decoder "
                          "block other than DeepSeek's)")
    return layers


class MaxTextModel:
    """A MaxText model with what a Baton training step and MaxText's own step need.

    ``MaxTextModel(model, batch=, **overrides)``: ``load_config``'s arguments. ``config``:
    MaxText's config; ``mesh``: MaxText's mesh on ``devices`` (default the first
    ``rank_size(config)`` devices; ``device``: one), the shape of every pipeline rank;
    ``model``: its NNX ``Transformer`` built on that mesh (left unmarked); ``tx``: MaxText's
    optimizer. See the module docstring."""

    def __init__(self, model: str | dict = "llama2", *, batch: int = 8, device=None,
                 devices: Sequence[Any] | None = None, **overrides):
        require_maxtext()
        import jax
        from flax import nnx
        from maxtext.utils import maxtext_utils_nnx, model_creation_utils, train_utils

        self._spec = (model, batch, overrides)
        cfg = load_config(model, batch=batch, **overrides)
        if cfg.num_experts > 1 and cfg.load_balance_loss_weight > 0 and not cfg.scan_layers:
            raise ConfigError(
                "load_balance_loss_weight > 0 with scan_layers=False: MaxText sows each MoE "
                "layer's load-balance loss and reads it in the loss, a value that would cross "
                "pipeline stages without a stage boundary; use scan_layers=True (MaxText's "
                "default; the sown values then travel through the stage boundaries) or "
                "load_balance_loss_weight=0")
        check_expert_axis(cfg)
        self.config = cfg
        if devices is None:
            devices = [device] if device is not None else jax.devices()[:rank_size(cfg)]
        self.devices = list(devices)
        self.device = self.devices[0]
        self.mesh = mesh_of(cfg, self.devices)
        rngs = maxtext_utils_nnx.create_nnx_rngs(cfg)
        self.model = model_creation_utils.create_model(cfg, self.mesh, rngs=rngs)
        self.num_layers = (_scanned_layer_count(self.model) if cfg.scan_layers
                           else len(_decoder_layers(self.model)))
        self.lr_schedule, self.tx = train_utils.create_training_optimizer(cfg, self.model,
                                                                          mesh=self.mesh)
        # the parameters as MaxText shards them on its mesh (its logical axis rules)
        self._params = jax.device_put(nnx.as_pure(nnx.state(self.model, nnx.Param)),
                                      self.param_shardings())
        self._configs = {cfg.gradient_accumulation_steps: cfg}
        self._ref: dict = {}

    # --- data, parameters, optimizer state ---

    @property
    def batch_size(self) -> int:
        return int(self.config.global_batch_size_to_train_on)

    def make_batch(self, seed: int, padding: bool = True) -> dict[str, np.ndarray]:
        """``synthetic_batch(self.config, seed, padding)``."""
        return synthetic_batch(self.config, seed, padding)

    def init_params(self, stages: int | None = None) -> Any:
        """The model's parameters: the pure ``nnx.State`` (arrays) that ``nnx.Optimizer`` of
        MaxText's train state updates, same paths and values. With ``stages`` and
        ``scan_layers=True`` each scanned stack's arrays are split into one piece per stage it
        spans (``baton.Stacked`` along each leaf's layer axis; a stack within one stage stays
        whole): each rank then holds only its own layers and their optimizer state;
        ``baton.join_stacks`` gives MaxText's layout back."""
        if stages is None or not self.config.scan_layers:
            return self._params
        import jax

        from ..stacks import Stacked

        axis = layer_axis_of(self.config)
        stacks = scanned_stacks(self.config)
        pieces = stack_pieces(stacks, stages)  # (too many stages: raises)

        def piece(path, x):
            names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
            name = names[1] if names[:1] == ["decoder"] and len(names) > 1 else None
            rows = pieces.get(name)
            if not rows or len(rows) == 1:  # (a stack within one stage: placed whole there)
                return x
            ax = axis(path, x)
            if np.shape(x)[ax:ax + 1] != (dict(stacks)[name],):
                return x  # (a leaf without the layer axis: every stage reads it whole)
            return Stacked([jax.lax.slice_in_dim(x, a, b, axis=ax) for _, a, b in rows], ax)

        return jax.tree_util.tree_map_with_path(piece, self._params)

    def param_shardings(self, mesh=None) -> Any:
        """MaxText's shardings of the parameters (``NamedSharding``s on ``mesh``, default the
        model's mesh, in ``init_params()``'s layout): its logical annotations under its
        ``logical_axis_rules`` (``sharding.nnx_construct_named_sharding``, as MaxText's
        training setup places its state), e.g. the experts over the ``expert`` axis."""
        import jax
        from flax import nnx
        from flax.core.spmd import logical_axis_rules
        from maxtext.utils import sharding

        with logical_axis_rules(self.config.logical_axis_rules):
            named = sharding.nnx_construct_named_sharding(nnx.state(self.model, nnx.Param),
                                                          self.mesh if mesh is None else mesh)
        return jax.tree.map(lambda v: v.get_value(), named,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))

    def init_opt_state(self, params: Any = None) -> Any:
        return self.tx.init(self.init_params() if params is None else params)

    def config_with(self, grad_accum: int) -> Any:
        """MaxText's config again with ``gradient_accumulation_steps=grad_accum``."""
        cfg = self._configs.get(grad_accum)
        if cfg is None:
            model, batch, overrides = self._spec
            cfg = load_config(model, batch=batch,
                              **{**overrides, "gradient_accumulation_steps": grad_accum})
            self._configs[grad_accum] = cfg
        return cfg

    # --- Baton ---

    def staged_model(self, stages: int):
        """``(graphdef, rest)`` of a copy of the model whose last layer of every stage but the
        last ends in ``baton.stage_boundary`` (``stage_end_class``)."""
        from flax import nnx

        marked = nnx.clone(self.model)
        groups = split_layers(self.num_layers, stages)
        if self.config.scan_layers:
            dec = marked.decoder
            if stages > 1:
                dec.__class__ = staged_decoder_class(type(dec), stages)
            graphdef, _, rest = nnx.split(marked, nnx.Param, ...)
            return graphdef, rest
        layers = _decoder_layers(marked)
        for group in groups[:-1]:
            layer = layers[group[-1]]
            layer.__class__ = stage_end_class(type(layer))
        graphdef, _, rest = nnx.split(marked, nnx.Param, ...)
        return graphdef, rest

    def microbatch_loss(self, stages: int, microbatches: int):
        """``f(params, tokens, microbatch) -> (objective, reported)``: MaxText's ``loss_fn`` on
        the staged model for one microbatch, ``objective`` divided by the batch's ``tokens``
        (see the module docstring); ``reported`` sums over microbatches to MaxText's loss."""
        from flax import nnx
        from flax.core.spmd import logical_axis_rules
        from maxtext.trainers.pre_train import train

        graphdef, rest = self.staged_model(stages)
        cfg = self.config_with(microbatches)

        def loss(params, tokens, mb):
            with logical_axis_rules(cfg.logical_axis_rules):
                model = nnx.merge(graphdef, params, rest, copy=True)
                value, aux = train.loss_fn(model, cfg, dict(mb), None, None, is_train=True)
            if microbatches == 1:  # MaxText's GA=1 loss is already normalized
                return value, value
            aux_sum = aux["moe_lb_loss"] + aux["indexer_loss"] + aux["mtp_loss"]
            return value / tokens, aux["xent_sum"] / tokens + aux_sum / microbatches

        return loss

    def pipeline_step(self, mesh, schedule, microbatches: int, stages: int | None = None,
                      **jit_kwargs):
        """A ``baton.jit`` training step ``(params, opt_state, batch) -> (params, opt_state,
        loss)``: ``microbatches`` microbatches through ``schedule`` on ``mesh`` (see
        ``pipeline_mesh``), then MaxText's gradient clipping and optimizer. ``jit_kwargs`` go
        to ``baton.jit`` (ranks of several devices in one process on CPUs:
        ``single_program=False``)."""
        import jax
        import jax.numpy as jnp
        import optax

        from .. import frontend

        if stages is None:
            stages = schedule.stages(mesh.num_ranks)
        if self.batch_size % microbatches:
            raise ConfigError(f"batch {self.batch_size} is not divisible by "
                              f"microbatches={microbatches}")
        vg = jax.value_and_grad(self.microbatch_loss(stages, microbatches), has_aux=True)
        clip = float(self.config.gradient_clipping_threshold)
        tx = self.tx

        def maxtext_order(x):
            # MaxText's gradient accumulation gives microbatch j the rows j, j + M, j + 2M, ...
            # (gradient_accumulation.py); Baton's microbatch j is the j-th block of rows
            s = x.shape[0] // microbatches
            return x.reshape((s, microbatches) + x.shape[1:]).swapaxes(0, 1).reshape(x.shape)

        def step(params, opt_state, batch):
            batch = jax.tree.map(maxtext_order, batch)
            tokens = jnp.maximum(jnp.sum(batch["targets_segmentation"] != 0), 1)
            (_, loss), grads = frontend.accumulate(vg, params, tokens.astype(jnp.float32),
                                                   batch=batch, reduce="sum")
            if clip > 0:  # maxtext_utils.apply_gradient_clipping
                grads, _ = optax.clip_by_global_norm(clip).update(grads, None)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return frontend.jit(step, mesh=mesh, schedule=schedule, microbatches=microbatches,
                            **jit_kwargs)

    # --- MaxText's own step ---

    def _reference(self, devices: Sequence[Any] | None = None):
        """``(mesh, graphdef, shardings, init)`` of MaxText's training setup on ``devices``
        (default: the model's): its mesh for them, the train state's graph and shardings (as
        ``maxtext_utils.get_abstract_state`` derives them) and its factory."""
        devices = self.devices if devices is None else list(devices)
        key = tuple(d.id for d in devices)
        got = self._ref.get(key)
        if got is None:
            from flax import nnx
            from flax.core.spmd import logical_axis_rules
            from maxtext.common import train_state_nnx
            from maxtext.utils import maxtext_utils, maxtext_utils_nnx, model_creation_utils

            cfg = self.config
            mesh = mesh_of(cfg, devices)

            def init():
                model = model_creation_utils.create_model(
                    cfg, mesh, rngs=maxtext_utils_nnx.create_nnx_rngs(cfg))
                return train_state_nnx.TrainStateNNX(
                    model, nnx.Optimizer(model, self.tx, wrt=nnx.Param))

            _, _, shardings = maxtext_utils.get_abstract_state(cfg, mesh, init, True)
            with logical_axis_rules(cfg.logical_axis_rules):
                graphdef = nnx.graphdef(nnx.eval_shape(init))
            got = self._ref[key] = (mesh, graphdef, shardings, init)
        return got

    def reference_state(self, devices: Sequence[Any] | None = None) -> Any:
        """MaxText's train state (``TrainStateNNX``: model + ``nnx.Optimizer`` with ``tx``) on
        MaxText's mesh for ``devices`` (default: the model's), placed in MaxText's state
        shardings, split: the pure state that ``reference_step`` takes and returns. Its
        parameters are ``init_params()``'s."""
        import jax
        from flax import nnx

        _, _, shardings, init = self._reference(devices)
        state = init()
        nnx.update(state.model, jax.device_get(self._params))
        return jax.device_put(nnx.split(state)[1], shardings)

    def reference_step(self, grad_accum: int = 1, devices: Sequence[Any] | None = None):
        """MaxText's own ``train_step`` (not pipelined), jitted as MaxText's trainer jits it
        (``get_functional_train_with_signature``: the state in its shardings, the batch in
        MaxText's input data sharding) on MaxText's mesh for ``devices`` (default: the
        model's): ``f(state, batch) -> (state, loss)``, with
        ``gradient_accumulation_steps=grad_accum``."""
        import jax
        from flax import nnx
        from flax.core.spmd import logical_axis_rules
        from maxtext.trainers.pre_train import train
        from maxtext.utils import maxtext_utils, sharding

        mesh, graphdef, shardings, _ = self._reference(devices)
        cfg = self.config_with(grad_accum)
        _, params_shardings, _ = nnx.split(shardings.model, nnx.Param, ...)
        data_sharding = sharding.get_input_data_sharding(cfg, mesh)
        fn, in_sh, out_sh, _, donate = maxtext_utils.get_functional_train_with_signature(
            train.train_step, data_sharding, shardings, graphdef, cfg, params_shardings)
        fn = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)

        def step(state, batch):
            with jax.set_mesh(mesh), logical_axis_rules(cfg.logical_axis_rules):
                state, metrics = fn(state, batch)
            return state, metrics["scalar"]["learning/loss"]

        return step

    def reference_params(self, state) -> Any:
        """The parameters in a ``reference_state``, in ``init_params``'s layout."""
        from flax import nnx

        graphdef = self._reference()[1]  # (any devices': only the parameters are read)
        return nnx.as_pure(nnx.state(nnx.merge(graphdef, state).model, nnx.Param))


def build(model: str | dict = "llama2", *, batch: int = 8, device=None,
          devices: Sequence[Any] | None = None, **overrides) -> MaxTextModel:
    """A tiny MaxText model (``CONFIGS``: ``"llama2"``, ``"mixtral"``, ``"deepseek2"``) with a
    global batch of ``batch`` sequences; ``overrides`` are MaxText config keys. The model is
    built on MaxText's mesh for ``devices`` (default: the first ``rank_size`` devices, one unless an
    ``ici_*_parallelism`` is set, e.g. ``ici_expert_parallelism=2``; ``device``: one)."""
    return MaxTextModel(model, batch=batch, device=device, devices=devices, **overrides)


def pipeline_mesh(model: MaxTextModel, ranks: int, devices: Sequence[Any] | None = None):
    """A ``baton.PipelineMesh`` of ``ranks`` ranks, each a sub-mesh shaped like the model's
    mesh (MaxText's mesh axes and sizes, e.g. ``expert=2``; the pipe axis is MaxText's
    ``stage``), so the sharding constraints inside MaxText's layers and MaxText's parameter
    shardings name axes every rank has. ``devices``: default the first ``ranks`` x (the
    model's devices) devices; rank r holds the r-th block of them."""
    import jax
    from jax.sharding import Mesh

    from ..frontend import PipelineMesh

    shape = dict(model.mesh.shape)
    per = int(np.prod(list(shape.values()), dtype=np.int64))
    devs = list(jax.devices()[:ranks * per] if devices is None else devices)
    if len(devs) != ranks * per:
        raise ConfigError(f"pipeline_mesh: {ranks} ranks of {per} device(s) (the model's mesh) "
                          f"need {ranks * per} devices (have {len(devs)}; set "
                          f"JAX_NUM_CPU_DEVICES={ranks * per} on CPUs)")
    axes = [a for a in model.mesh.axis_names if a != "stage"]
    arr = np.array(devs, dtype=object).reshape((ranks,) + tuple(shape[a] for a in axes))
    types = dict(zip(model.mesh.axis_names, model.mesh.axis_types))
    return PipelineMesh(Mesh(arr, ("stage", *axes),
                             axis_types=(types["stage"], *(types[a] for a in axes))),
                        axis="stage")
