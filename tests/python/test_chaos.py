"""bench/chaos.py's machinery on two faults (the 50-run batch is bench/results/chaos.md).

Two processes train the chaos worker's 12-layer MLP with a checkpoint every 3 steps:

* process 1 SIGKILLs itself right after its write of the step-6 checkpoint, before the commit
  exchange (``baton.checkpoint.commit._test_hook``): process 0 exits with an error naming rank 1,
  step 6 is not committed, and the run resumes from step 3 to the reference's losses and
  final state, bit for bit;
* process 0 is SIGSTOPped in the training loop (no save in flight): process 1 exits at its
  transfer timeout naming rank 0; process 0, thawed, exits with an error too; the resume
  from the newest committed step matches the reference.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
try:
    import chaos  # noqa: E402
finally:
    # bench/ holds maxtext.py: left on the path it would shadow the MaxText package for
    # every later test in this worker.
    sys.path.remove(str(BENCH))

TIMEOUT, LIMIT, HARD = 10.0, 60.0, 90.0


@pytest.mark.heavy
def test_kill_during_save_and_freeze_in_loop_resume_exactly(tmp_path):
    ref = chaos.reference(2, str(tmp_path), TIMEOUT, measure_restore=False)
    kill = chaos.Spec(0, 2, "save", "KILL", 1, 0.0, hook="written:6:KILL", at_step=6)
    rec = chaos.chaos_run(kill, ref, str(tmp_path), TIMEOUT, LIMIT, HARD)
    assert not rec["failures"], rec
    assert rec["hit"] == "save (written)", rec
    assert "rank 1" in rec["errors"][0], rec
    assert rec["committed_before_resume"] == [3] and rec["resumed_from"] == 3, rec
    assert rec["resume_verified"], rec
    assert rec["exit_s"][0] < LIMIT, rec

    stop = chaos.Spec(1, 2, "loop", "STOP", 0, 0.0, at_step=5)
    rec = chaos.chaos_run(stop, ref, str(tmp_path), TIMEOUT, LIMIT, HARD)
    assert not rec["failures"], rec
    # a frozen peer is noticed by the timeout
    assert "rank 0" in rec["errors"][1] and "timed out after 10 s" in rec["errors"][1], rec
    assert rec["exit_s"][1] < LIMIT, rec
    assert rec["thawed_code"] == 3, rec
    assert rec["resumed_from"] == 3 and rec["resume_verified"], rec
