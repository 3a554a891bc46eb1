"""``receives_early``: receives moved as early as batched exchanges allow, never later, never a deadlock.

For every schedule the generators make (and forward-only forms), the moved
schedule passes ``validate`` (order, matching, in-flight bound, and a dry run
of batched exchanges that finishes), keeps each stage's sends and compute
actions where they were, posts no receive later than ``lower`` did, and,
simulated as the runtime runs it on gloo (``posted``: a message travels once
both sides are posted), is never slower than the lowered schedule: the same
step without transfer time, no longer with it. 1F1B at p=2, m=4 is checked
action by action.
"""

from __future__ import annotations

import pytest

from autopar.schedules import Schedule, ScheduleError, Sends, forward_only, generate, lower, receives_early, simulate

CASES = [(name, p, v, m) for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2))
         for p, m in ((2, 4), (3, 6), (4, 8))] + [("interleaved", 4, 3, 8), ("1f1b", 4, 1, 2)]


def _positions(schedule: Schedule) -> dict:
    """Each send and receive -> how many compute actions its stage runs before it."""
    out = {}
    for acts in schedule.actions.values():
        done = 0
        for a in acts:
            if a.is_compute:
                done += 1
            else:
                out[a] = done
    return out


@pytest.mark.parametrize("name,p,v,m", CASES)
@pytest.mark.parametrize("evaluation", [False, True])
def test_receives_move_earlier_and_the_step_gets_no_longer(name, p, v, m, evaluation):
    compute = generate(name, p, v, m)
    lowered = lower(forward_only(compute) if evaluation else compute)
    early = receives_early(lowered)  # validated inside: no deadlock under batched exchanges
    for s, acts in early.actions.items():
        assert [a for a in acts if not a.is_recv] == [a for a in lowered.actions[s] if not a.is_recv]
    before, after = _positions(lowered), _positions(early)
    assert all(after[a] <= before[a] for a in before if a.is_recv)
    assert any(after[a] < before[a] for a in before if a.is_recv), "no receive moved"
    for comm in (0, 0.25):
        late = simulate(lowered, 1, 2, comm, sends=Sends.POSTED).step_time
        assert simulate(early, 1, 2, comm, sends=Sends.POSTED).step_time <= late + 1e-9


def test_1f1b_last_stage_receives_its_activations_a_compute_earlier():
    early = receives_early(lower(generate("1f1b", 2, 1, 4)))
    # stage 1's activations are posted before the compute preceding their forward (stage 0 runs its
    # forwards ahead); stage 0's gradient receives would each close a cycle with one of them under
    # batched exchanges, so they stay where lower put them, but the last two join one batch
    assert " ".join(map(str, early.actions[1])) == ("RF1.0<0 RF1.1<0 F1.0 B1.0 SB1.0>0 RF1.2<0 F1.1 B1.1 SB1.1>0 "
                                                    "RF1.3<0 F1.2 B1.2 SB1.2>0 F1.3 B1.3 SB1.3>0")
    assert " ".join(map(str, early.actions[0])) == ("F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 F0.2 SF0.2>1 RB0.1<1 "
                                                    "B0.1 F0.3 SF0.3>1 RB0.2<1 RB0.3<1 B0.2 B0.3")


def test_a_single_stage_is_returned_as_it_is_and_a_compute_only_schedule_refused():
    single = lower(generate("1f1b", 1, 1, 4))
    assert receives_early(single) is single
    with pytest.raises(ScheduleError, match="lower it first"):
        receives_early(generate("1f1b", 2, 1, 4))
