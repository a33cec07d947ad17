"""The CUDA path of the rank-program transfers: the CUDA XLA FFI handlers
(``_core.ffi.handlers_cuda``) and ``_core.runtime.NcclRankComm``.

Runs without a GPU: the handlers exist and register with JAX for platform "CUDA"
(registration needs no device), and constructing ``NcclRankComm`` without a CUDA device
raises a clear ``ConfigError``. What needs a GPU is in bench/gpu_check.sh.
"""

import tempfile

import jax
import pytest

import baton
from baton import _core
from baton.emit import ffi

needs_cuda_build = pytest.mark.skipif(
    not _core.ffi.has_cuda(), reason="_core built without CUDA/nccl.h (no CUDA handlers)")


def _has_gpu():
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def test_has_cuda_is_a_bool():
    assert isinstance(_core.ffi.has_cuda(), bool)
    assert ffi.has_cuda() == _core.ffi.has_cuda()
    if not _core.ffi.has_cuda():
        with pytest.raises(RuntimeError, match="without CUDA"):
            _core.ffi.handlers_cuda()


@needs_cuda_build
def test_cuda_handlers_match_the_cpu_ones():
    cpu, cuda = _core.ffi.handlers(), _core.ffi.handlers_cuda()
    # the CPU build also has a debugging target (baton_device_ordinal)
    assert set(cuda) == {"baton_comm", "baton_drain", "baton_mark"} <= set(cpu)
    for name in cuda:
        assert type(cuda[name]).__name__ == "PyCapsule"
        assert cuda[name] is not cpu[name]


@needs_cuda_build
def test_cuda_handlers_register_with_jax():
    # Registering for a platform whose plugin is absent is deferred by JAX, not an error.
    for name, capsule in _core.ffi.handlers_cuda().items():
        jax.ffi.register_ffi_target(name + "_cuda_test", capsule, platform="CUDA")
    ffi.register()  # CPU and CUDA, idempotent
    ffi.register()


def test_register_keeps_the_cpu_path_working():
    import jax.numpy as jnp
    import numpy as np

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU handlers run on the CPU backend")
    ffi.register()
    comm = _core.runtime.RankComm(0, 5.0)
    comm.record(True)

    @jax.jit
    def f(x):
        tok = jnp.zeros((), jnp.int32)
        tok = ffi.mark(comm.id, 0, tok)
        y = x + 1
        tok = ffi.mark(comm.id, 1, tok, (y,))
        return y, tok

    y, _ = f(jnp.arange(4.0, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(y), np.arange(1.0, 5.0))
    assert [p for p, _ in comm.take_marks()] == [0, 1]


def test_nccl_rank_comm_without_a_gpu_raises_clearly():
    if _has_gpu():
        pytest.skip("a GPU is present (bench/gpu_check.sh covers it)")
    store = _core.runtime.file_store(tempfile.mkdtemp())
    if not _core.ffi.has_cuda():
        assert not _core.runtime.NcclRankComm.built()
        with pytest.raises(baton.ConfigError, match="built without CUDA"):
            _core.runtime.NcclRankComm(0, 2, 0, store, [(1, 0, True)])
        return
    assert _core.runtime.NcclRankComm.built()
    with pytest.raises(baton.ConfigError, match="needs a CUDA device"):
        _core.runtime.NcclRankComm(0, 2, 0, store, [(1, 0, True), (1, 1, False)], timeout=5.0)
    # Bad arguments are reported before CUDA is touched.
    # (a link to the rank itself is a self link now, not an error: a peer out of range is)
    with pytest.raises(baton.ConfigError, match="peer 2 is invalid"):
        _core.runtime.NcclRankComm(0, 2, 0, store, [(2, 0, True)])
    with pytest.raises(baton.ConfigError, match="invalid for world size"):
        _core.runtime.NcclRankComm(3, 2, 0, store, [])
