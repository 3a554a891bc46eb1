"""Zero-bubble schedules as data (tier a: no process group): W actions, chunk placements,
ZB-H1 and ZB-V validated over every p <= 8, p <= m <= 32, their exact unit-cost bubbles and
in-flight peaks, lowering, broken schedules refused, and PyTorch's own ZB orders side by side.

Costs are integers, so every time and bubble is an exact Fraction: equalities are exact.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from functools import cache

import pytest

from autopar.core.config import ParallelConfig, microbatch_errors
from autopar.schedules import (
    Action,
    Kind,
    Placement,
    Schedule,
    ScheduleError,
    chunk_placement,
    dry_run,
    forward_only,
    generate,
    lower,
    num_warmup,
    one_f_one_b,
    parse_grid,
    peak_in_flight,
    simulate,
    validate,
)

V_OF = {"zb-h1": 1, "zbv": 2}
CASES = [(name, p, m) for name in V_OF for p in range(1, 9) for m in range(p, 33)]


@cache
def _zb(name: str, p: int, m: int) -> Schedule:
    return generate(name, p, V_OF[name], m)  # generate validates what it returns


def _idle(schedule: Schedule, cost_f: int = 1, cost_b: int = 2, cost_w: int = 1) -> dict[int, Fraction]:
    """Per stage, makespan minus compute time (exact: integer costs)."""
    run = dry_run(schedule, cost_f, cost_b, cost_w)
    return {s: run.makespan - busy for s, busy in run.busy.items()}


# --------------------------------------------------------------------------- actions, placement


def test_w_action_text_and_kind() -> None:
    w = Action.parse("W3.5")
    assert (w.kind, w.chunk, w.microbatch, w.peer) == (Kind.W, 3, 5, None)
    assert str(w) == "W3.5" and w.is_compute and not w.is_comm
    with pytest.raises(ValueError, match="must not have a peer"):
        Action(Kind.W, 0, 0, 1)


def test_chunk_placement() -> None:
    assert chunk_placement("zbv", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert chunk_placement("interleaved", 4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert chunk_placement("zb-h1", 3, 1) == (0, 1, 2)
    schedule = _zb("zbv", 4, 8)
    assert schedule.placement is Placement.V
    assert [schedule.chunks_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert all(schedule.stage_of(c) == s for c, s in enumerate(chunk_placement("zbv", 4, 2)))
    with pytest.raises(ValueError, match="unknown schedule 'zb-h3'"):
        chunk_placement("zb-h3", 4, 1)
    with pytest.raises(ValueError, match="unknown chunk placement 'w'; known: interleaved, v"):
        Schedule("x", 1, 1, 1, {0: []}, placement="w")


def test_grid_round_trip_keeps_placement_and_w() -> None:
    for name, p, m in [("zbv", 2, 3), ("zb-h1", 3, 4)]:
        schedule = _zb(name, p, m)
        for s in (schedule, lower(schedule), forward_only(schedule)):
            text = str(s)
            assert ("placement=v" in text.splitlines()[0]) == (name == "zbv")
            assert parse_grid(text) == s


# --------------------------------------------------------------------------- the whole grid


def test_every_zero_bubble_schedule_over_the_grid() -> None:
    """Every p <= 8, p <= m <= 32 generates valid (validated inside generate); exact unit-cost idle
    time per stage; in-flight peaks equal the designed bounds; warm-up counts as documented."""
    for name, p, m in CASES:
        schedule = _zb(name, p, m)
        assert schedule.splits_backward
        idle = _idle(schedule)
        if name == "zb-h1":
            # (p-1)(t_f + t_b - 2 t_w) with t_b the whole backward: (p-1)(1 + 2 - 2)
            assert idle == dict.fromkeys(range(p), p - 1), (name, p, m)
            # until W: p on every stage (1F1B's stage-0 peak); until B: exactly 1F1B's peaks
            assert peak_in_flight(schedule) == dict.fromkeys(range(p), min(p, m))
            assert peak_in_flight(schedule, Kind.B) == peak_in_flight(one_f_one_b(p, m))
        else:
            # the startup (p-1 chunk forwards) once the V fills; holes of dropped microbatches before
            assert idle == dict.fromkeys(range(p), max(p - 1, 2 * (2 * p - 1 - m))), (name, p, m)
            assert peak_in_flight(schedule) == {r: min(m + r + 1, 2 * p) for r in range(p)}
            assert peak_in_flight(schedule, Kind.B) == peak_in_flight(schedule)
        assert peak_in_flight(schedule) == {r: schedule.in_flight_bound(r) for r in range(p)}
        for r, acts in schedule.actions.items():
            first_b = next(t for t, a in enumerate(acts) if a.kind is Kind.B)
            assert first_b == num_warmup(name, p, V_OF[name], m, r) + 1


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_per_p", [1, 2, 4])
def test_unit_cost_bubble_fractions(p: int, m_per_p: int) -> None:
    """F = B = W = 1 (a whole backward costs 2): idle / makespan exactly, against 1F1B's."""
    m = p * m_per_p
    one_f = dry_run(one_f_one_b(p, m), 1, 2)
    assert one_f.makespan - one_f.busy[0] == 3 * (p - 1)
    assert Fraction(one_f.makespan - one_f.busy[0], one_f.makespan) == Fraction(3 * (p - 1), 3 * m + 3 * (p - 1))
    h1 = dry_run(_zb("zb-h1", p, m), 1, 2, 1)
    assert Fraction(h1.makespan - h1.busy[0], h1.makespan) == Fraction(p - 1, 3 * m + p - 1)
    assert h1.bubble_fraction == Fraction(p - 1, 3 * m)  # idle / compute: a third of 1F1B's (p-1)/m
    zbv = dry_run(_zb("zbv", p, m), 1, 2, 1)  # per-chunk costs: 6 m per stage
    idle = max(p - 1, 2 * (2 * p - 1 - m))
    assert zbv.bubble_fraction == Fraction(idle, 6 * m)
    if m >= 2 * p:
        assert zbv.bubble_fraction == Fraction(p - 1, 6 * m)  # half ZB-H1's: a chunk forward per hop


@pytest.mark.parametrize("t_f,t_b,t_w", [(2, 5, 2), (2, 3, 1), (3, 4, 1), (1, 4, 1), (2, 3, 2), (3, 7, 3)])
def test_zb_h1_idle_for_other_costs(t_f: int, t_b: int, t_w: int) -> None:
    """With t_w <= t_f, ZB-H1's idle time is the paper's (p-1)(T_F + T_B - T_W) (T_B = t_b - t_w, the
    input gradient), but never below the startup (p-1) t_f, which no schedule with a synchronous
    step avoids."""
    for p, m in [(2, 8), (4, 8), (4, 16)]:
        expected = (p - 1) * max(t_f + (t_b - t_w) - t_w, t_f)
        assert _idle(_zb("zb-h1", p, m), t_f, t_b, t_w) == dict.fromkeys(range(p), expected)


# --------------------------------------------------------------------------- costs, lowering


def test_cost_w_defaults_to_half_the_backward_and_is_checked() -> None:
    schedule = _zb("zb-h1", 4, 8)
    assert dry_run(schedule, 1, 2).makespan == dry_run(schedule, 1, 2, 1).makespan == 27
    run = simulate(schedule, 1, 4, sends="batched", cost_w=3)
    durations = {e.kind: e.end - e.start for evs in run.events.values() for e in evs}
    assert durations == {"F": 1, "B": 1, "W": 3}
    with pytest.raises(ValueError, match="weight-gradient cost 3 exceeds the whole backward's 2"):
        dry_run(schedule, 1, 2, 3)
    # a schedule without W ignores cost_w: its B is the whole backward
    assert dry_run(one_f_one_b(4, 8), 1, 2, 1).makespan == 33


def test_lowering_zero_bubble_schedules() -> None:
    """W sends and receives nothing; ZB-V's turn (chunks p-1 and p, one stage) needs no message;
    the lowered schedule keeps the compute-only timing (batched and posted sends, F = B = W = 1)."""
    for name, p, m in [("zb-h1", 4, 8), ("zbv", 4, 8), ("zbv", 3, 4), ("zb-h1", 8, 16), ("zbv", 8, 16)]:
        schedule = _zb(name, p, m)
        lowered = lower(schedule)  # validates
        comm = [a for acts in lowered.actions.values() for a in acts if a.is_comm]
        chunks = 2 * p if name == "zbv" else p
        hops = (chunks - 1) - (1 if name == "zbv" else 0)  # cross-stage neighbours
        assert len(comm) == 2 * 2 * hops * m  # SF + RF and SB + RB per hop and microbatch
        assert not any(a.chunk == p - 1 and a.kind is Kind.SEND_F for a in comm if name == "zbv")
        compute_only = dry_run(schedule, 1, 2, 1).makespan
        assert dry_run(lowered, 1, 2, 1).makespan == compute_only
        assert simulate(lowered, 1, 2, sends="posted", cost_w=1).step_time == compute_only


# --------------------------------------------------------------------------- broken schedules


def _refused_by_validate(schedule: Schedule, match: str) -> str:
    with pytest.raises(ScheduleError, match=match) as info:
        validate(schedule)
    message = str(info.value)
    for s, t in info.value.marks:  # the grid in the message marks the failing actions
        assert f"[{schedule.actions[s][t]}]" in message
    return message


def test_broken_zero_bubble_schedules_are_refused() -> None:
    good = _zb("zb-h1", 2, 2)  # stage 0: F0.0 F0.1 B0.0 W0.0 B0.1 W0.1
    acts = good.actions[0]
    w_first = [acts[0], acts[3], *acts[1:3], *acts[4:]]  # W0.0 before its B0.0
    message = _refused_by_validate(dataclasses.replace(good, actions={**good.actions, 0: w_first}),
                       r"W0\.0 on stage 0 runs before B0\.0, which it needs")
    assert "(marked: stage 0 step 1, stage 0 step 3)" in message
    missing = [a for a in acts if str(a) != "W0.1"]
    _refused_by_validate(dataclasses.replace(good, actions={**good.actions, 0: missing}),
             r"missing W0\.1 \(on stage 0\) : a schedule with W actions splits every backward")
    custom = parse_grid("mine p=1 v=1 m=2\nstage 0: F0.0 F0.1 B0.0 W0.0 B0.1")
    _refused_by_validate(custom, r"missing W0\.1")
    split_1f1b = parse_grid("1f1b p=1 v=1 m=1\nstage 0: F0.0 B0.0 W0.0")
    _refused_by_validate(split_1f1b, r"W0\.0 on stage 0: 1f1b does not split its backwards")
    unsplit_zb = parse_grid("zb-h1 p=1 v=1 m=1\nstage 0: F0.0 B0.0")
    _refused_by_validate(unsplit_zb, r"missing W0\.0")
    eval_w = parse_grid("zb-h1 p=1 v=1 m=1 forward-only\nstage 0: F0.0 W0.0")
    _refused_by_validate(eval_w, r"W0\.0 on stage 0: a forward-only schedule runs no backward")
    wrong_stage = parse_grid("zbv p=2 v=2 m=1 placement=v\nstage 0: F0.0 F2.0\nstage 1: F1.0 F3.0")
    _refused_by_validate(dataclasses.replace(wrong_stage, forward_only=True),
                         r"F2\.0 is on stage 0, but chunk 2 lives on stage 1")


def test_in_flight_bound_of_zb_h1_is_enforced() -> None:
    """Delaying stage 0's first W past its cool-down B's holds p + 1 microbatches: refused."""
    good = _zb("zb-h1", 2, 3)  # stage 0: F0.0 F0.1 B0.0 W0.0 F0.2 B0.1 W0.1 B0.2 W0.2
    acts = good.actions[0]
    late = [a for a in acts if str(a) != "W0.0"] + [Action.parse("W0.0")]
    _refused_by_validate(dataclasses.replace(good, actions={**good.actions, 0: late}),
             r"stage 0 holds 3 activations after F0\.2, above the zb-h1 bound of 2")


def test_layout_rules_name_the_numbers() -> None:
    assert microbatch_errors("zbv", 4, 1, 8) == ["zbv runs 2 chunks per stage (a V), got v=1; use v=2"]
    assert "zb-h1 needs at least one microbatch per stage: m=3 < p=4" in microbatch_errors("zb-h1", 4, 1, 3)[0]
    assert "'zbv' for v=2" in microbatch_errors("zb-h1", 4, 2, 8)[0]
    with pytest.raises(ValueError, match="zbv runs 2 chunks per stage"):
        generate("zbv", 2, 1, 4)
    assert ParallelConfig(pp=4, virtual_stages=2, microbatches=8, schedule="zbv").schedule == "zbv"
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved'"):
        ParallelConfig(pp=4, virtual_stages=2, microbatches=8, schedule="zb-h1")


# --------------------------------------------------------------------------- PyTorch side by side


class _FakeStage:
    """What PyTorch's zero-bubble schedules read from a stage to compute their order."""

    def __init__(self, index: int, num_stages: int, group_size: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, group_size, 0
        self.submod = None
        self.is_first, self.is_last = index == 0, index == num_stages - 1


def _torch_order(schedule_obj) -> dict[int, list[str]]:
    """PyTorch's per-rank compute order in autopar's text (I, its input gradient, is autopar's B)."""
    code = {"F": "F", "I": "B", "W": "W"}
    return {rank: [f"{code[a.computation_type.value]}{a.stage_index}.{a.microbatch_index}" for a in acts if a]
            for rank, acts in schedule_obj.pipeline_order.items()}


def test_pytorch_zero_bubble_orders_side_by_side() -> None:
    """PyTorch's ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble (one stage per rank: ZB-H1)
    build their orders in __init__ from stage objects; with light fake stages and no process group
    their per-rank orders equal autopar's, so their unit-cost makespans do too."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    compared = 0
    for p in range(1, 9):
        for m in sorted({p, p + 1, 2 * p - 1, 2 * p, 3 * p, 32}):
            ours_v = {r: list(map(str, acts)) for r, acts in _zb("zbv", p, m).actions.items()}
            theirs = schedules.ScheduleZBVZeroBubble([_FakeStage(0, 2 * p, p), _FakeStage(2 * p - 1, 2 * p, p)], m)
            assert _torch_order(theirs) == ours_v, (p, m)
            if m % max(1, m // p) == 0:  # PyTorch's rule: m a multiple of its rounds, max(1, m // p)
                ours_h1 = {r: list(map(str, acts)) for r, acts in _zb("zb-h1", p, m).actions.items()}
                theirs = schedules.ScheduleInterleavedZeroBubble([_FakeStage(0, p, p)], m)
                assert _torch_order(theirs) == ours_h1, (p, m)
                # its slots (Nones for the bubbles it adds) span exactly our unit-cost makespan
                assert max(map(len, theirs.pipeline_order.values())) == dry_run(_zb("zb-h1", p, m), 1, 2, 1).makespan
            compared += 1
    assert compared > 40
