"""V-Min and V-Half (controllable-memory V schedules) from Python: the specs, their names,
and their plans verified and simulated. Their memory and bubble against 1F1B over many sizes
are checked in C++ (test_integration_schedules.cc); one end-to-end step of each runs in
test_e2e.py."""

from __future__ import annotations

import pytest

import baton
from baton import _core


@pytest.mark.parametrize("spec,name", [(baton.VMin(), "vmin"), (baton.VHalf(), "vhalf")])
def test_spec_builds_a_v_schedule(spec, name):
    assert spec.stages(4) == 8
    s = spec.build(4, 8)
    assert s.name == name and s.num_stages == 8 and s.split_backward()
    assert list(s.stage_rank) == list(_core.v_placement(4))
    assert baton.schedule_from_name(name.replace("v", "V-", 1)) == spec
    assert name in baton.schedule_names()


def test_plans_verify_and_hold_less_than_one_f_one_b():
    """On the default unit costs (F=1, I=W=1 per stage; the V schedules' stages are
    chunks of half a 1F1B stage), the simulated peak stash of V-Min is about a third of
    1F1B's and V-Half's about a half; ZB-V's is about 1F1B's."""
    ranks, m = 8, 32
    half = _core.CostModel.uniform(0.5, 1.0, 0.5, 0.5)

    def peak(name, costs=None):
        p = baton.plan(name, ranks=ranks, microbatches=m)
        p.verify()
        return max(p.simulate(costs).peak_activation)

    one_f_one_b = 2 * peak("1f1b")  # in half-stage chunks
    assert one_f_one_b == 2 * ranks
    vmin, vhalf, zbv = peak("vmin", half), peak("vhalf", half), peak("zbv", half)
    assert vmin / one_f_one_b <= 0.43
    assert vmin < vhalf and vhalf / one_f_one_b <= 0.63
    assert zbv / one_f_one_b > 1.0


def test_bad_sizes_name_the_schedule():
    with pytest.raises(baton.ScheduleError, match="vmin needs ranks >= 1"):
        _core.make_schedule("vmin", 0, 4, 1)
    with pytest.raises(baton.ConfigError, match="ranks must be a positive integer"):
        baton.VHalf().build(0, 4)
