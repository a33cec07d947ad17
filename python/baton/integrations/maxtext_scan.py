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
"""

from __future__ import annotations

from ..errors import ConfigError

_STAGED: dict[tuple[type, int], type] = {}


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


def cut_stack(layers, length: int, stages: int) -> list[tuple[object, int]]:
    """``layers`` (MaxText's scanned stack of ``length`` layers) as ``stages`` modules of
    consecutive layers: ``[(module, layers in it), ...]`` (sizes as ``stacks._groups``). A
    variable holding a :class:`baton.Stacked` value (parameters split per stage) gives each
    group its piece."""
    import jax
    from flax import nnx

    from ..stacks import Stacked, _groups

    if not 1 <= stages <= length:
        raise ConfigError(f"cannot cut {length} scanned decoder layers into {stages} stages "
                          f"(each stage needs a layer; raise base_num_decoder_layers)")
    graphdef, state = nnx.split(layers)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    out = []
    for g, (a, b) in enumerate(_groups(length, stages)):
        def rows(var, g=g, a=a, b=b):
            value = var.get_value()
            if isinstance(value, Stacked):
                if value.sizes != [y - x for x, y in _groups(length, stages)]:
                    raise ConfigError(f"MaxText's scanned stack is split {value.sizes}, not in "
                                      f"{stages} stages; split it with init_params(stages="
                                      f"{stages})")
                return var.replace(value=value.pieces[g])
            axis = _layer_axis(var, length)
            if axis is None:
                return var
            return var.replace(value=jax.lax.slice_in_dim(var.get_value(), a, b, axis=axis))

        out.append((nnx.merge(graphdef, jax.tree.map(rows, state, is_leaf=is_var)), b - a))
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
    """A subclass of MaxText's decoder class ``base`` whose scan over its main layer stack
    (``self.layers``) runs as ``stages`` scans with a stage boundary between them (see the
    module docstring). Other stacks (DeepSeek's dense and MoE stacks) and calls with external
    KV caches are refused or passed through unchanged. One class per ``(base, stages)``."""
    cls = _STAGED.get((base, stages))
    if cls is not None:
        return cls
    import jax
    from flax import nnx

    from ..frontend import stage_boundary

    def _apply_layers_sequentially(self, layers, x_in, *args, length, kv_caches_stacked=None,
                                   **kwargs):
        main = getattr(self, "layers", None)
        if layers is not main or kv_caches_stacked is not None:
            if any(getattr(self, n, None) is layers for n in ("dense_layers", "moe_layers")):
                raise ConfigError("baton.integrations.maxtext cuts the generic scanned decoder "
                                  "stack (NNXDecoder.layers); DeepSeek's dense/MoE stacks are "
                                  "not supported")
            return base._apply_layers_sequentially(
                self, layers, x_in, *args, length=length, kv_caches_stacked=kv_caches_stacked,
                **kwargs)
        y, sown = x_in, []
        groups = cut_stack(layers, length, stages)
        for g, (group, n) in enumerate(groups):
            y, group, _ = base._apply_layers_sequentially(self, group, y, *args, length=n,
                                                          **kwargs)
            sown.append(nnx.state(group, nnx.Intermediate))
            if g < len(groups) - 1:  # the values sown so far travel with the activations
                y, sown = stage_boundary((y, sown))
        joined = _join_sown(sown)
        if jax.tree.leaves(joined):
            nnx.update(layers, joined)
        return y, layers, None

    cls = type(f"Staged{base.__name__}", (base,),
               {"_apply_layers_sequentially": _apply_layers_sequentially,
                "__module__": __name__, "__qualname__": f"Staged{base.__name__}",
                "baton_stages": stages})
    _STAGED[(base, stages)] = cls
    return cls

