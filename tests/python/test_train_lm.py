"""examples/train_lm.py as a user runs it: a run that stops after its step-3 checkpoint and
resumes from it (in 2 launched processes) gives the same losses, bit for bit, as a run that
never stopped (one process), on a text file as data."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "train_lm.py")
COMMON = ["--dim", "32", "--seq", "16", "--batch", "8", "--microbatches", "4", "--heads", "2",
          "--data", str(ROOT / "README.md"), "--print-losses"]


def _run(args, launched=False, timeout=300):
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1" if launched else "2", JAX_PLATFORMS="cpu")
    cmd = [sys.executable] + (["-m", "baton.launch", "--nprocs", "2", "--timeout", "250"]
                              if launched else []) + [SCRIPT, *COMMON, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    return out, {int(m[1]): m[2] for m in re.finditer(r"^loss (\d+) (\S+)$", p.stdout, re.M)}


@pytest.mark.heavy
def test_stop_and_resume_gives_the_same_losses(tmp_path):
    # the run that never stops checkpoints at steps 3 and 6; removing step 6's COMMITTED
    # marker leaves the directory as a run killed while saving step 6 leaves it (the step-3
    # checkpoint the latest), and the resumed run (2 launched processes) redoes steps 4-6
    ck = str(tmp_path / "ckpt")
    _, straight = _run(["--ranks", "2", "--steps", "6", "--ckpt", ck, "--ckpt-every", "3"])
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    os.remove(os.path.join(ck, "6", "COMMITTED"))
    out, resumed = _run(["--steps", "6", "--ckpt", ck, "--ckpt-every", "3", "--resume"],
                        launched=True)
    assert "resumed from step 3" in out, out[-3000:]
    assert resumed == {i: straight[i] for i in (4, 5, 6)}, (resumed, straight)
    assert os.path.isfile(os.path.join(ck, "6", "COMMITTED"))
