"""The environment baton.launch gives processes on GPUs (baton.runtime.gpu_share): eager
module loading unless the user chose a mode, and each process sharing a GPU its part of the
memory XLA takes. Host-side logic, no GPU and no JAX needed."""

import pytest

from baton.runtime.gpu_share import XLA_DEFAULT_MEM_FRACTION, gpu_share_env


def test_eager_module_loading_unless_the_user_chose():
    assert gpu_share_env(0, 1, [], {})["CUDA_MODULE_LOADING"] == "EAGER"
    assert "CUDA_MODULE_LOADING" not in gpu_share_env(0, 1, ["0"], {"CUDA_MODULE_LOADING": "LAZY"})


def test_one_process_per_gpu_keeps_xlas_memory():
    for r in range(2):
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in gpu_share_env(r, 2, ["0", "1"], {})


def test_two_processes_on_one_gpu_split_it():
    envs = [gpu_share_env(r, 2, ["0"], {}) for r in range(2)]
    fracs = [float(e["XLA_PYTHON_CLIENT_MEM_FRACTION"]) for e in envs]
    assert fracs == [XLA_DEFAULT_MEM_FRACTION / 2] * 2
    user = gpu_share_env(1, 2, ["0"], {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"})
    assert float(user["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == pytest.approx(0.45)


def test_uneven_sharing_counts_the_processes_on_each_gpu():
    # 3 processes on 2 GPUs: GPU 0 has ranks 0 and 2, GPU 1 has rank 1 alone
    assert float(gpu_share_env(0, 3, ["0", "1"], {})["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == 0.375
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in gpu_share_env(1, 3, ["0", "1"], {})


def test_a_bad_fraction_is_named():
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='lots'"):
        gpu_share_env(0, 2, ["0"], {"XLA_PYTHON_CLIENT_MEM_FRACTION": "lots"})
