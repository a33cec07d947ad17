"""MaxText's scanned decoder stack (``scan_layers=True``, its default) cut into pipeline stages.

With ``scan_layers=True`` MaxText 0.2.5 keeps the decoder layers as one NNX module
(``NNXDecoder.layers``) whose variables are stacked along a layer axis (``param_scan_axis``,
1 by default, for parameters of rank > 1; 0 otherwise) and runs them in
``NNXDecoder._apply_layers_sequentially``: one ``jax.lax.scan`` over a body wrapped in
``jax.checkpoint`` with MaxText's ``remat_policy``. The staged copy of the model gets a decoder
subclass (:func:`staged_decoder_class`) whose ``_apply_layers_sequentially`` calls MaxText's
own method once per stage group, on a module holding that group's rows of every stacked
variable (:func:`cut_stack`), with a ``baton.stage_boundary`` between groups. Each stage's
layers stay one scan under MaxText's remat policy, so compile time does not grow with the layer
count, and MaxText's files are not changed.

**Sown values.** A layer's ``sow`` inside the scan (the MoE load-balance loss
``moe_lb_loss``, MaxText's internal metrics) comes out of each group's scan stacked over the
group's layers. The groups' values travel with the activations through every later stage
boundary (a pipeline's only way between stages, so their gradients flow back the same way)
and are joined along the layer axis into the stack, where MaxText's ``loss_fn`` pops them as it
would after one scan over all layers.

**Several stacks.** DeepSeek's decoder block scans two stacks one after the other: its first
``first_num_dense_layers`` dense layers (``NNXDecoder.dense_layers``), then its MoE layers
(``moe_layers``). The stages cut the layers of both in order (:func:`scanned_stacks`,
:func:`stack_pieces`): a stage may end inside either stack or where one ends, and each stage's
part of a stack stays one scan. The values an earlier stack sowed travel on with the later
stack's activations through its stage boundaries and are put back into their stack after its
last group, in the last stage.
"""

from __future__ import annotations

from ..errors import ConfigError

_STAGED: dict[tuple[type, int], type] = {}
# per decoder being traced: (stage reached, sown values) its earlier stacks left for the next
_CARRY: dict[int, tuple] = {}


def _layer_axis(var, length: int) -> int | None:
    """The axis of ``var``'s value that holds the ``length`` layers (MaxText's rule: its
    ``param_scan_axis`` metadata when the value has more dimensions than that, else 0), or
    ``None`` for a value without one (a scalar MaxText broadcasts itself)."""
    shape = tuple(getattr(var.get_value(), "shape", ()))
    axis = int(var.get_metadata().get("param_scan_axis", 0))
    if len(shape) <= axis:
        axis = 0
    if not shape or shape[axis] != length:
        return None
    return axis


def layer_axis_of(config):
    """``(path, leaf) -> axis``: where a leaf of the stacked parameters holds its layers
    (``param_scan_axis`` for leaves of higher rank, else 0), for ``baton.split_stacks``."""
    scan_axis = int(config.param_scan_axis)
    return lambda path, x: scan_axis if len(getattr(x, "shape", ())) > scan_axis else 0


def scanned_stacks(config) -> list[tuple[str, int]]:
    """The decoder's scanned stacks in the order it runs them: ``(attribute of the decoder,
    layer count)``; ``[("layers", L)]`` for the generic stack, the dense then the MoE stack for
    DeepSeek's. Decoder blocks that scan blocks of layers, and DeepSeek's variants that scan
    otherwise (engram layers, lineage, the batch-split schedule), raise ``ConfigError``."""
    n = int(config.num_decoder_layers)
    block = str(getattr(config.decoder_block, "value", config.decoder_block)).lower()
    if block == "deepseek":
        for flag in ("engram_layers", "use_lineage", "use_batch_split_schedule"):
            if getattr(config, flag, None):
                raise ConfigError(f"baton.integrations.maxtext cuts DeepSeek's scanned dense "
                                  f"and MoE stacks; {flag} scans them otherwise: unset it or "
                                  f"set scan_layers=False")
        dense = int(config.first_num_dense_layers)
        return [(name, k) for name, k in (("dense_layers", dense), ("moe_layers", n - dense))
                if k > 0]
    if int(config.inhomogeneous_layer_cycle_interval) != 1:
        raise ConfigError("baton.integrations.maxtext cuts MaxText's scanned decoder stacks of "
                          "one layer per scan step; this decoder block "
                          f"({config.decoder_block}) scans blocks of layers: set "
                          "scan_layers=False")
    return [("layers", n)]


def stack_pieces(stacks: list[tuple[str, int]], stages: int) -> dict[str, list[tuple]]:
    """Per stack, its parts in the stages: ``{name: [(stage, first row, end row), ...]}``,
    the rows counted within the stack; the stages take the stacks' layers in order, in groups
    as ``stacks._groups`` sizes them."""
    from ..stacks import _groups

    total = sum(k for _, k in stacks)
    if not 1 <= stages <= total:
        raise ConfigError(f"cannot cut {total} scanned decoder layers into {stages} stages "
                          f"(each stage needs a layer; raise base_num_decoder_layers)")
    out, start = {}, 0
    for name, k in stacks:
        out[name] = [(g, max(a, start) - start, min(b, start + k) - start)
                     for g, (a, b) in enumerate(_groups(total, stages))
                     if max(a, start) < min(b, start + k)]
        start += k
    return out


def cut_stack(layers, length: int, rows: list[tuple[int, int]]) -> list[tuple[object, int]]:
    """``layers`` (MaxText's scanned stack of ``length`` layers) as one module per range of
    ``rows`` (consecutive ``(first, end)``): ``[(module, layers in it), ...]``. A variable
    holding a :class:`baton.Stacked` value (parameters split per stage) gives each range its
    piece."""
    import jax
    from flax import nnx

    from ..stacks import Stacked

    graphdef, state = nnx.split(layers)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    sizes = [b - a for a, b in rows]
    out = []
    for g, (a, b) in enumerate(rows):
        def piece(var, g=g, a=a, b=b):
            value = var.get_value()
            if isinstance(value, Stacked):
                if value.sizes != sizes:
                    raise ConfigError(f"MaxText's scanned stack is split {value.sizes}, not "
                                      f"{sizes} as the stages cut it; split the parameters "
                                      f"with init_params(stages=...) of the step's stages")
                return var.replace(value=value.pieces[g])
            axis = _layer_axis(var, length)
            if axis is None or (a, b) == (0, length):
                return var
            return var.replace(value=jax.lax.slice_in_dim(value, a, b, axis=axis))

        out.append((nnx.merge(graphdef, jax.tree.map(piece, state, is_leaf=is_var)), b - a))
    return out


def _join_sown(parts: list) -> object:
    """The groups' sown ``nnx.Intermediate`` states joined along the layer axis (0)."""
    import jax
    import jax.numpy as jnp

    structs = {jax.tree.structure(p) for p in parts}
    if len(structs) != 1:
        raise ConfigError("the stage groups of MaxText's scanned decoder sowed different "
                          "values; cannot join them into one stack")
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)


def staged_decoder_class(base: type, stages: int) -> type:
    """A subclass of MaxText's decoder class ``base`` whose scans over its layer stacks
    (:func:`scanned_stacks`) run as ``stages`` groups of scans with a stage boundary between
    stages (see the module docstring). Calls with external KV caches pass through unchanged.
    One class per ``(base, stages)``."""
    cls = _STAGED.get((base, stages))
    if cls is not None:
        return cls
    import jax
    from flax import nnx

    from ..frontend import stage_boundary

    def _apply_layers_sequentially(self, layers, x_in, *args, length, kv_caches_stacked=None,
                                   **kwargs):
        stacks = scanned_stacks(self.config)
        name = next((a for a, _ in stacks if getattr(self, a, None) is layers), None)
        if name is None or kv_caches_stacked is not None:
            return base._apply_layers_sequentially(
                self, layers, x_in, *args, length=length, kv_caches_stacked=kv_caches_stacked,
                **kwargs)
        if length != dict(stacks)[name]:
            raise ConfigError(f"MaxText scans {length} layers of decoder.{name}; its config "
                              f"has {dict(stacks)[name]}: cannot cut them into stages")
        first, last = name == stacks[0][0], name == stacks[-1][0]
        # what the earlier stacks of this call left: the stage reached and their sown values
        carry = _CARRY.pop(id(self), None)
        stage, sown = carry if carry is not None and not first else (0, [])
        pieces = stack_pieces(stacks, stages)[name]
        y = x_in
        for g, (module, n) in zip([p[0] for p in pieces],
                                  cut_stack(layers, length, [p[1:] for p in pieces])):
            if g > stage:  # the values sown so far travel with the activations
                y, vals = stage_boundary((y, [v for _, v in sown]))
                sown, stage = [(m, v) for (m, _), v in zip(sown, vals)], g
            y, module, _ = base._apply_layers_sequentially(self, module, y, *args, length=n,
                                                           **kwargs)
            sown.append((layers, nnx.state(module, nnx.Intermediate)))
        if not last:
            _CARRY[id(self)] = (stage, sown)
            return y, layers, None
        for stack in {id(m): m for m, _ in sown}.values():
            joined = _join_sown([v for m, v in sown if m is stack])
            if jax.tree.leaves(joined):
                nnx.update(stack, joined)
        return y, layers, None

    cls = type(f"Staged{base.__name__}", (base,),
               {"_apply_layers_sequentially": _apply_layers_sequentially,
                "__module__": __name__, "__qualname__": f"Staged{base.__name__}",
                "baton_stages": stages})
    _STAGED[(base, stages)] = cls
    return cls

