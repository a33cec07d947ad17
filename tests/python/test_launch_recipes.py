"""The launch recipes under examples/launch: the one-process-per-GPU sbatch script run on this
machine under an emulated SLURM (a stand-in ``srun`` on PATH that starts the tasks as local CPU
processes with SLURM's variables), the Kubernetes JobSet manifest checked against a JSON schema
of JobSet v1alpha2's fields, and ``baton.launch``'s one GPU per process."""

from __future__ import annotations

import json
import os
import pathlib
import re
import stat
import subprocess
import sys

import pytest

from baton import launch

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPES = ROOT / "examples" / "launch"

# SLURM's per-task variables as srun sets them on one node (SLURM_STEP_NODELIST: the node
# list jax.distributed's SLURM detection reads; its coordinator port comes from the job id)
FAKE_SRUN = r'''#!/usr/bin/env python3
"""Stand-in for srun: starts SLURM_NTASKS copies of the command on this host."""
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("--"):
    args.pop(0)  # srun's options (--kill-on-bad-exit=1, --cpu-bind=cores)
n = int(os.environ["SLURM_NTASKS"])
procs = []
for i in range(n):
    env = dict(os.environ, SLURM_PROCID=str(i), SLURM_LOCALID=str(i), SLURM_NODEID="0",
               SLURM_STEP_NODELIST="localhost", SLURM_STEP_NUM_NODES="1",
               SLURM_STEP_NUM_TASKS=str(n))
    procs.append(subprocess.Popen(args, env=env))
codes = [p.wait() for p in procs]
sys.exit(next((c for c in codes if c), 0))
'''


@pytest.mark.parametrize("script", ["train_lm_per_gpu.sbatch", "train_lm_per_host.sbatch"])
def test_sbatch_scripts_are_bash(script):
    text = (RECIPES / script).read_text()
    assert text.startswith("#!/bin/bash")
    assert re.search(r"^#SBATCH --ntasks-per-node=", text, re.M)
    assert subprocess.run(["bash", "-n", str(RECIPES / script)]).returncode == 0


def test_sbatch_under_emulated_slurm(tmp_path):
    """3 tasks (3 pipeline ranks, 1F1B) of examples/train_lm.py started by the sbatch script
    through the stand-in srun: jax.distributed.initialize from SLURM's variables, each task
    pinned (CUDA_VISIBLE_DEVICES = its local id), two steps trained, the same loss in every
    task's output."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    srun = bindir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    job = str(1000 + os.getpid() % 3000)  # jax.distributed's port: job id mod 4096
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID=job,
               SLURM_NTASKS="3", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost",
               BATON_PYTHON=sys.executable, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1",
               BATON_HOSTNAME="127.0.0.1")
    env.pop("BATON_RANK", None)
    p = subprocess.run(["bash", str(RECIPES / "train_lm_per_gpu.sbatch"), "--steps", "2",
                        "--batch", "4", "--microbatches", "2", "--seq", "8", "--dim", "16",
                        "--heads", "2", "--print-losses"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "over 3 ranks (launched)" in out, out[-3000:]
    losses = re.findall(r"^loss 2 (\S+)$", p.stdout, re.M)
    assert len(losses) == 1, out[-3000:]  # rank 0 prints
    assert float(losses[0]) > 0


def test_jobset_manifest_matches_the_schema():
    yaml = pytest.importorskip("yaml")
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((RECIPES / "jobset.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    doc = yaml.safe_load((RECIPES / "jobset.yaml").read_text())
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    # the pieces fit together: a process per pod, the coordinator is pod 0 of the JobSet
    rj = doc["spec"]["replicatedJobs"][0]
    job = rj["template"]["spec"]
    env = {e["name"]: e for e in job["template"]["spec"]["containers"][0]["env"]}
    assert int(env["JAX_NUM_PROCESSES"]["value"]) == rj["replicas"] * job["completions"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    name = doc["metadata"]["name"]
    assert env["JAX_COORDINATOR_ADDRESS"]["value"].startswith(
        f"{name}-{rj['name']}-0-0.{name}:")
    assert doc["spec"]["network"]["enableDNSHostnames"] is True
    # the check can fail: a manifest without a container image, a misspelled kind
    bad = json.loads(json.dumps(doc))
    del bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["image"]
    with pytest.raises(jsonschema.ValidationError, match="'image' is a required property"):
        jsonschema.validate(bad, schema, cls=jsonschema.Draft202012Validator)
    bad = dict(doc, kind="Jobset")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema, cls=jsonschema.Draft202012Validator)


def test_launch_pins_one_gpu_per_process(tmp_path):
    """python -m baton.launch --nprocs 8 with 8 visible GPUs: process r sees GPU r alone."""
    script = tmp_path / "show.py"
    script.write_text("import os, sys\n"
                      "open(os.path.join(sys.argv[1], 'rank' + os.environ['BATON_RANK']), 'w')"
                      ".write(os.environ.get('CUDA_VISIBLE_DEVICES', '-'))\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")

    def seen(nprocs, *opts):
        out = tmp_path / f"out{nprocs}{''.join(opts)}"
        out.mkdir()
        p = subprocess.run([sys.executable, "-m", "baton.launch", "--nprocs", str(nprocs),
                            *opts, str(script), str(out)],
                           env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return {f.name: f.read_text() for f in out.iterdir()}

    assert seen(8) == {f"rank{r}": str(r) for r in range(8)}
    assert seen(2, "--no-pin") == {f"rank{r}": "0,1,2,3,4,5,6,7" for r in range(2)}


def test_pinning_rules():
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "4, 5"}) == ["4", "5"]
    assert launch.pinned_gpu(3, ["4", "5"]) == "5"  # more processes than GPUs: shared
    assert launch.pinned_gpu(0, []) is None
    from baton.runtime.rendezvous import local_gpu
    assert local_gpu(5, {"CUDA_VISIBLE_DEVICES": "5"}) == 0
    assert local_gpu(1, {"CUDA_VISIBLE_DEVICES": "0,1"}) == 1
    assert local_gpu(3, {}) == 3
