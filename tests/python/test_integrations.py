"""``baton.integrations.maxtext`` without MaxText: it imports, its pure helpers work, and what
needs MaxText says how to install it (the MaxText tests themselves: test_maxtext.py, run in
.venv-maxtext)."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest

import baton
from baton.integrations import maxtext as bmt


def test_split_layers():
    assert bmt.split_layers(4, 4) == [[0], [1], [2], [3]]
    assert bmt.split_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert bmt.split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(baton.ConfigError, match="cannot cut 2 decoder layers into 3 stages"):
        bmt.split_layers(2, 3)


def test_stage_end_class_marks_the_layer_output():
    class Layer:
        def __call__(self, x, kv_cache=None):
            return jnp.tanh(x), kv_cache

    layer = Layer()
    layer.__class__ = bmt.stage_end_class(Layer)
    assert bmt.stage_end_class(Layer) is type(layer) and isinstance(layer, Layer)
    jaxpr = jax.make_jaxpr(lambda x: layer(x)[0])(jnp.ones(3))
    assert [e.primitive.name for e in jaxpr.eqns] == ["tanh", "stage_boundary"]


def test_without_maxtext_the_error_names_the_install_command():
    spec = importlib.util.find_spec("maxtext")
    if spec is not None and spec.submodule_search_locations:
        bmt.require_maxtext()  # the MaxText venv: nothing to refuse
        return
    with pytest.raises(ImportError, match="scripts/setup_maxtext.sh"):
        bmt.build("llama2")
