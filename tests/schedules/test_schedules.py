"""Pipeline schedules as data (tier a: no process group).

Every generated schedule over a grid of (p, v, m) is validated as generated
and as lowered; bubbles are checked exactly (integer costs give Fractions),
in-flight peaks and warm-up counts against the paper's formulas, grids round
trip through text, bad input names the numbers, and validate catches
hand-broken schedules.
"""

from __future__ import annotations

from fractions import Fraction
from functools import cache

import pytest

import autopar.schedules.validation as validation_module
from autopar.schedules import (
    SCHEDULE_NAMES,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    dry_run,
    generate,
    gpipe,
    interleaved_1f1b,
    lower,
    num_warmup,
    one_f_one_b,
    parse_grid,
    peak_in_flight,
    validate,
)

# m up to 32: every m <= 9 (where the edge cases live: m < p, m == p, m % p != 0) and two
# large ones; for interleaved, the first four multiples of p and the largest one <= 32.
_MS = [*range(1, 10), 16, 32]


def _grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for p in range(1, 9):
        interleaved_ms = sorted({p, 2 * p, 3 * p, 4 * p, 32 // p * p} & set(range(1, 33)))
        for v in range(1, 5):
            cases += [("gpipe", p, v, m) for m in _MS]
            cases += [("interleaved", p, v, m) for m in interleaved_ms]
        cases += [("1f1b", p, 1, m) for m in _MS if m >= p]
    return cases


CASES = _grid()
IDS = [f"{n}-p{p}-v{v}-m{m}" for n, p, v, m in CASES]


@cache
def _schedules(name: str, p: int, v: int, m: int) -> tuple[Schedule, Schedule]:
    schedule = generate(name, p, v, m)  # generators validate what they return
    return schedule, lower(schedule)  # and lower validates its result


def _paper_warmup(name: str, p: int, v: int, m: int, r: int) -> int:
    """The paper's warm-up forwards on rank r, capped at the stage's v*m forwards."""
    return {
        "gpipe": v * m,
        "1f1b": min(p - r - 1, m),
        "interleaved": min((p - r - 1) * 2 + (v - 1) * p, v * m),
    }[name]


def _paper_bubble(name: str, p: int, v: int, m: int) -> Fraction:
    if name == "gpipe":  # (p-1)/(v m), plus a wait per chunk round while m < p
        return Fraction(p - 1 + (v - 1) * max(p - m, 0), v * m)
    return Fraction(p - 1, v * m)  # 1f1b (v = 1) and interleaved


# --------------------------------------------------------------------------- actions and grids


@pytest.mark.parametrize(
    "action, text",
    [
        (Action(Kind.F, 2, 0), "F2.0"),
        (Action(Kind.B, 2, 0), "B2.0"),
        (Action(Kind.SEND_F, 2, 0, 3), "SF2.0>3"),
        (Action(Kind.RECV_F, 3, 0, 2), "RF3.0<2"),
        (Action(Kind.SEND_B, 13, 11, 0), "SB13.11>0"),
        (Action(Kind.RECV_B, 12, 11, 1), "RB12.11<1"),
    ],
)
def test_action_text_round_trip(action: Action, text: str) -> None:
    assert str(action) == text
    assert repr(action) == text
    assert Action.parse(text) == action


@pytest.mark.parametrize("text", ["X1.0", "F1", "F1.0>2", "SF1.0", "SF1.0<2", "RB1.0>2", "F-1.0"])
def test_action_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        Action.parse(text)


def test_action_peer_matches_kind() -> None:
    with pytest.raises(ValueError, match="must not have a peer"):
        Action(Kind.F, 0, 0, peer=1)
    with pytest.raises(ValueError, match="needs a peer"):
        Action(Kind.SEND_F, 0, 0)


def test_interleaved_golden_order() -> None:
    """p=2, v=2, m=4 by hand from Megatron-LM's get_model_chunk_id.

    Stage 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards, stage 1 with 2;
    chunks go in groups of p=2 microbatches, forwards 0,0,1,1 (local chunk),
    backwards 1,1,0,0.
    """
    expected = parse_grid(
        """
        interleaved p=2 v=2 m=4
        stage 0: F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3
        stage 1: F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3
        """
    )
    assert interleaved_1f1b(2, 2, 4) == expected


def test_one_f_one_b_golden_order() -> None:
    expected = parse_grid(
        """
        1f1b p=4 v=1 m=6
        stage 0: F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1 F0.5 B0.2 B0.3 B0.4 B0.5
        stage 1: F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 F1.4 B1.2 F1.5 B1.3 B1.4 B1.5
        stage 2: F2.0 F2.1 B2.0 F2.2 B2.1 F2.3 B2.2 F2.4 B2.3 F2.5 B2.4 B2.5
        stage 3: F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3 F3.4 B3.4 F3.5 B3.5
        """
    )
    assert one_f_one_b(4, 6) == expected


def test_lowered_golden() -> None:
    """Sends follow their compute; a receive sits in the gap its stage is in when the producer ends.

    With unit costs stage 0 sends F0.1's output at t=2, when stage 1 has just
    finished F1.0, so RF1.1 goes before B1.0 and its tensor waits in a buffer.
    """
    expected = parse_grid(
        """
        1f1b p=2 v=1 m=3
        stage 0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 F0.2 SF0.2>1 RB0.1<1 B0.1 RB0.2<1 B0.2
        stage 1: RF1.0<0 F1.0 RF1.1<0 B1.0 SB1.0>0 F1.1 B1.1 SB1.1>0 RF1.2<0 F1.2 B1.2 SB1.2>0
        """
    )
    assert lower(one_f_one_b(2, 3)) == expected


def test_grid_format() -> None:
    text = gpipe(2, 2).format_grid()
    assert text.splitlines() == [
        "gpipe p=2 v=1 m=2",
        "step     0    1    2    3",
        "stage 0: F0.0 F0.1 B0.0 B0.1",
        "stage 1: F1.0 F1.1 B1.0 B1.1",
    ]
    assert str(gpipe(2, 2)) == text


@pytest.mark.parametrize(("name", "p", "v", "m"), CASES[::7], ids=IDS[::7])
def test_grid_round_trip(name: str, p: int, v: int, m: int) -> None:
    for schedule in _schedules(name, p, v, m):
        assert parse_grid(schedule.format_grid()) == schedule


def test_grid_with_marks_parses_and_clipped_grid_does_not() -> None:
    schedule = lower(one_f_one_b(4, 8))
    marked = schedule.format_grid(marks=[(1, 3)])
    assert f"[{schedule.actions[1][3]}]" in marked
    assert parse_grid(marked) == schedule
    clipped = schedule.format_grid(columns=(5, 10))
    assert "..." in clipped and "step     ... 5" in clipped
    with pytest.raises(ValueError, match="clipped"):
        parse_grid(clipped)


# --------------------------------------------------------------------------- the grid of (p, v, m)


@pytest.mark.parametrize(("name", "p", "v", "m"), CASES, ids=IDS)
def test_generated_and_lowered_schedules(name: str, p: int, v: int, m: int) -> None:
    schedule, lowered = _schedules(name, p, v, m)  # both validated (test_validate_is_called)

    # Same compute order; one send and one receive per cross-stage edge (none when p == 1).
    assert {
        s: [a for a in acts if a.is_compute] for s, acts in lowered.actions.items()
    } == schedule.actions
    comm = [a for acts in lowered.actions.values() for a in acts if a.is_comm]
    edges = 2 * m * (p * v - 1) if p > 1 else 0  # F and B edges between consecutive chunks
    assert sum(a.is_send for a in comm) == sum(a.is_recv for a in comm) == edges

    # Warm-up: forwards before the first backward = min(w_r + 1, v m), w_r from the paper.
    for r, acts in schedule.actions.items():
        warmup = _paper_warmup(name, p, v, m, r)
        assert num_warmup(name, p, v, m, r) == warmup
        first_b = next(t for t, a in enumerate(acts) if a.kind is Kind.B)
        assert first_b == min(warmup + 1, v * m)

    # In flight: exactly the bound, on every stage, lowered or not.
    bounds = {r: schedule.in_flight_bound(r) for r in range(p)}
    assert peak_in_flight(schedule) == peak_in_flight(lowered) == bounds
    if name == "gpipe":
        assert set(bounds.values()) == {v * m}
    if name == "1f1b":
        assert bounds == {r: p - r for r in range(p)}  # m >= p, so min(p - r, m) = p - r <= p


@pytest.mark.parametrize(("name", "p", "v", "m"), CASES, ids=IDS)
def test_bubble_is_exact(name: str, p: int, v: int, m: int) -> None:
    """Unit costs and the paper's t_b = 2 t_f give the paper's bubble exactly, on every stage."""
    schedule, lowered = _schedules(name, p, v, m)
    expected = _paper_bubble(name, p, v, m)
    for cost_b in (1, 2):  # integer costs: exact Fraction bubbles
        run = dry_run(schedule, 1, cost_b)
        assert set(run.bubble.values()) == {expected}
        assert run.makespan == run.busy[0] * (1 + expected)
    # Lowered with the unit costs it was placed for, it times exactly as the compute-only form.
    unit = dry_run(lowered, 1, 1)
    assert set(unit.bubble.values()) == {expected}
    # With t_b = 2 t_f blocking exchanges cost GPipe and 1F1B nothing; interleaved can only lose.
    slow = dry_run(lowered, 1, 2)
    if name == "interleaved":
        assert slow.bubble_fraction >= expected
    else:
        assert set(slow.bubble.values()) == {expected}


def test_validate_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generators validate what they return and lower() its result: the grid needs no second run."""
    seen: list[tuple[str, bool]] = []
    real = validation_module.validate

    def spy(schedule: Schedule) -> None:
        seen.append((schedule.name, schedule.is_lowered))
        real(schedule)

    monkeypatch.setattr(validation_module, "validate", spy)
    for name in SCHEDULE_NAMES:
        lower(generate(name, 2, _v_of(name), 4))
    assert seen == [(name, lowered) for name in SCHEDULE_NAMES for lowered in (False, True)]

    # what validate raises is what the generators and lower() raise: they return nothing unchecked
    def reject(schedule: Schedule) -> None:
        raise ScheduleError(f"rejected {schedule.name} lowered={schedule.is_lowered}")

    monkeypatch.setattr(validation_module, "validate", reject)
    for name in SCHEDULE_NAMES:
        with pytest.raises(ScheduleError, match=f"rejected {name} lowered=False"):
            generate(name, 2, _v_of(name), 4)
    compute_only = parse_grid("1f1b p=2 v=1 m=2\nstage 0: F0.0 F0.1 B0.0 B0.1\nstage 1: F1.0 B1.0 F1.1 B1.1")
    with pytest.raises(ScheduleError, match="rejected 1f1b lowered=True"):
        lower(compute_only)


def test_paper_bubble_numbers() -> None:
    assert dry_run(one_f_one_b(4, 8)).bubble_fraction == pytest.approx(3 / 8, abs=1e-9)
    assert dry_run(gpipe(4, 8)).bubble_fraction == pytest.approx(3 / 8, abs=1e-9)
    assert dry_run(interleaved_1f1b(4, 2, 8)).bubble_fraction == pytest.approx(3 / 16, abs=1e-9)


def test_interleaved_blocking_exchange_cost() -> None:
    """Documented in lower(): with t_b = 2 t_f the lowered interleaved schedule loses bubble."""
    schedule = interleaved_1f1b(2, 2, 4)
    assert dry_run(schedule, 1, 2).bubble_fraction == Fraction(1, 8)  # (p-1)/(v m)
    assert dry_run(lower(schedule), 1, 2).bubble_fraction == Fraction(7, 24)


def test_one_f_one_b_holds_at_most_p() -> None:
    for p, m in [(4, 4), (4, 32), (8, 9)]:
        assert peak_in_flight(one_f_one_b(p, m)) == {r: p - r for r in range(p)}
        assert peak_in_flight(gpipe(p, m)) == dict.fromkeys(range(p), m)
        assert peak_in_flight(gpipe(p, m, v=3)) == dict.fromkeys(range(p), 3 * m)


# --------------------------------------------------------------------------- dry run


def test_dry_run_with_per_chunk_costs() -> None:
    """p=2, v=1, m=1 with F(c) = c+1 and B = 2 F: 1 + 2 + 4 + 2 = 9 end to end."""
    run = dry_run(gpipe(2, 1), cost_f=lambda a: a.chunk + 1, cost_b=lambda a: 2 * (a.chunk + 1))
    assert run.makespan == 9
    assert run.start == {0: [0, 7], 1: [1, 3]}
    assert run.end == {0: [1, 9], 1: [3, 7]}
    assert run.busy == {0: 3, 1: 6}
    assert run.bubble == {0: 2, 1: Fraction(1, 2)}
    assert isinstance(run.bubble[1], Fraction)  # integer costs, exact bubble


def test_dry_run_respects_dependencies() -> None:
    schedule = lower(interleaved_1f1b(4, 2, 8))
    run = dry_run(schedule, 1.0, 2.0)
    at = {a.key: (s, t) for s, acts in schedule.actions.items() for t, a in enumerate(acts)}
    last = schedule.num_chunks - 1
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            if a.kind is Kind.F and a.chunk > 0:
                ps, pt = at[(Kind.F, a.chunk - 1, a.microbatch)]
                assert run.start[s][t] >= run.end[ps][pt]
            if a.kind is Kind.B:
                fs, ft = at[(Kind.F, a.chunk, a.microbatch)]
                assert run.start[s][t] >= run.end[fs][ft]
                if a.chunk < last:
                    bs, bt = at[(Kind.B, a.chunk + 1, a.microbatch)]
                    assert run.start[s][t] >= run.end[bs][bt]
            if a.is_compute:
                assert run.end[s][t] - run.start[s][t] == (1.0 if a.kind is Kind.F else 2.0)
            if t and (a.is_compute or acts[t - 1].is_compute):
                assert run.start[s][t] >= run.end[s][t - 1]  # one unit at a time per stage


def test_single_stage_has_no_bubble_and_no_messages() -> None:
    schedule = interleaved_1f1b(1, 4, 3)
    assert lower(schedule) == schedule
    run = dry_run(schedule, 1.0, 2.0)
    assert run.makespan == 3 * 4 * 3.0 and run.bubble == {0: 0.0}


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: generate("zb-h1", 4, 1, 2), r"m=2 < p=4\. Use m >= 4 .* or '1f1b' or 'gpipe'"),
        (lambda: interleaved_1f1b(4, 2, 2), r"m=2 < p=4\. Use m >= 4"),
        (
            lambda: interleaved_1f1b(4, 2, 6),
            r"multiple of p .*m=6, p=4, m % p = 2\. Use m=4 or m=8",
        ),
        (lambda: interleaved_1f1b(4, 2, 10), r"m=10, p=4.*Use m=8 or m=12"),
        (lambda: gpipe(4, 8, v=0), r"v must be a positive integer, got v=0; use v >= 1"),
        (lambda: gpipe(0, 8), r"p must be a positive integer, got p=0; use p >= 1"),
        (lambda: interleaved_1f1b(2, 0, 4), r"got v=0"),
        (lambda: one_f_one_b(-1, 4), r"got p=-1"),
        (lambda: gpipe(2, 0), r"got m=0"),
        (lambda: generate("1f1b", 4, 2, 8), r"got v=2; use v=1, or 'interleaved'"),
        (
            lambda: generate("zb", 4, 1, 8),
            r"unknown schedule 'zb'; known: gpipe, 1f1b, interleaved",
        ),
        (lambda: Schedule("gpipe", 2, 1, 1, {0: []}), r"stages 0\.\.1, got stages \[0\]"),
        (lambda: Schedule("two words", 1, 1, 1, {0: []}), r"one non-empty word"),
        (lambda: lower(lower(gpipe(2, 2))), r"already lowered"),
    ],
)
def test_bad_input_names_the_numbers_and_the_fix(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def _v_of(name: str) -> int:
    """Chunks per stage to generate ``name`` with: ZB-V runs two (its V), the others can run one."""
    return 2 if name == "zbv" else 1


def test_schedule_names() -> None:
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
    for name in SCHEDULE_NAMES:
        assert generate(name, 2, _v_of(name), 4).name == name


# --------------------------------------------------------------------------- broken schedules


def _broken(text: str, match: str) -> ScheduleError:
    schedule = parse_grid(text)
    with pytest.raises(ScheduleError, match=match) as info:
        validate(schedule)
    message = str(info.value)
    for s, t in info.value.marks:  # the grid in the message marks the failing actions
        assert f"[{schedule.actions[s][t]}]" in message
    return info.value


def test_validate_catches_backward_before_forward() -> None:
    error = _broken(
        """
        1f1b p=2 v=1 m=2
        stage 0: F0.0 F0.1 B0.0 B0.1
        stage 1: B1.0 F1.0 F1.1 B1.1
        """,
        "B1.0 on stage 1 runs before F1.0, which it needs",
    )
    assert error.marks == ((1, 0), (1, 1))


def test_validate_catches_unmatched_send() -> None:
    error = _broken(
        """
        custom p=2 v=1 m=1
        stage 0: F0.0 SF0.0>1 RB0.0<1 B0.0
        stage 1: F1.0 B1.0 SB1.0>0
        """,
        r"SF0.0>1 on stage 0 has no matching receive RF1.0<0 on stage 1",
    )
    assert error.marks == ((0, 1),)


def test_validate_catches_missing_and_duplicate_actions() -> None:
    _broken(
        "gpipe p=2 v=1 m=2\nstage 0: F0.0 F0.1 B0.0 B0.1\nstage 1: F1.0 F1.1 B1.0", "missing B1.1"
    )
    _broken("gpipe p=2 v=1 m=1\nstage 0: F0.0 B0.0 F0.0\nstage 1: F1.0 B1.0", "F0.0 appears twice")
    _broken("gpipe p=2 v=1 m=1\nstage 0: F0.0 B0.0 F1.0\nstage 1: B1.0", "chunk 1 lives on stage 1")
    _broken("gpipe p=2 v=1 m=1\nstage 0: F0.0 B0.0 F0.1\nstage 1: F1.0 B1.0", "out of range")


def test_validate_catches_wrong_peer_and_needless_message() -> None:
    _broken(
        "custom p=3 v=1 m=1\nstage 0: F0.0 SF0.0>2 RB0.0<1 B0.0\n"
        "stage 1: RF1.0<0 F1.0 SF1.0>2 RB1.0<2 B1.0 SB1.0>0\nstage 2: RF2.0<1 F2.0 B2.0 SB2.0>1",
        "names peer 2, but chunk 1 lives on stage 1",
    )
    _broken("custom p=1 v=2 m=1\nstage 0: F0.0 SF0.0>0 F1.0 B1.0 B0.0", "not needed")


def test_validate_catches_missing_receive_in_lowered_schedule() -> None:
    _broken(
        """
        custom p=2 v=1 m=1
        stage 0: F0.0 SF0.0>1 B0.0
        stage 1: RF1.0<0 F1.0 B1.0
        """,
        "B0.0 on stage 0 needs RB0.0 before it",
    )


def test_validate_catches_in_flight_above_bound() -> None:
    """1F1B order on stage 0 of p=2 may hold 2; running all forwards first holds 3."""
    _broken(
        """
        1f1b p=2 v=1 m=3
        stage 0: F0.0 F0.1 F0.2 B0.0 B0.1 B0.2
        stage 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2
        """,
        "stage 0 holds 3 activations after F0.2, above the 1f1b bound of 2",
    )


def test_validate_catches_compute_deadlock() -> None:
    """Stage 0 runs chunk 2 first, but chunk 2 needs chunk 1, which needs stage 0's chunk 0."""
    error = _broken(
        """
        gpipe p=2 v=2 m=1
        stage 0: F2.0 F0.0 B2.0 B0.0
        stage 1: F1.0 F3.0 B3.0 B1.0
        """,
        "deadlock",
    )
    assert error.marks == ((0, 0), (1, 0))
    assert "stage 0 waits at F2.0 for F1.0 (stage 1 step 0) to finish" in str(error)


def test_validate_catches_exchange_deadlock() -> None:
    """Stage 1 posts its receive for microbatch 1 first; stage 0's send of microbatch 0 never ends.

    Sends block until matched, so stage 0 never reaches SF0.1 and stage 1 never gets RF1.1.
    """
    error = _broken(
        """
        custom p=2 v=1 m=2
        stage 0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 RB0.1<1 B0.1
        stage 1: RF1.1<0 F1.1 B1.1 SB1.1>0 RF1.0<0 F1.0 B1.0 SB1.0>0
        """,
        "deadlock",
    )
    assert error.marks == ((0, 1), (1, 0))
    assert "stage 0 waits in exchange [SF0.0>1] for RF1.0<0 (stage 1 step 4) to be posted" in str(
        error
    )


def test_batched_exchange_both_ways_is_not_a_deadlock() -> None:
    """In lowered GPipe p=2, v=2, m=2 each stage sends to and receives from the other in one batch.

    Stage 0 posts [SF0.1>1 RF2.0<1] while stage 1 posts [SF1.0>0 RF1.1<0]:
    both batches are posted, so all four transfers complete. Were the sends
    waited on one at a time before posting the receives, both would wait forever.
    """
    lowered = lower(gpipe(2, 2, v=2))
    text = lowered.format_grid()
    assert "F0.1    SF0.1>1 RF2.0<1 F2.0" in text
    assert "F1.0    SF1.0>0 RF1.1<0 F1.1" in text
    validate(lowered)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_1f1b_with_fewer_microbatches_than_stages(p: int) -> None:
    """m < p (Megatron-LM runs it): stage r warms up min(p - r - 1, m) forwards, holds at most
    min(p - r, m) activations, and with unit costs (F = 1, B = 2) the bubble is still (p-1)/m:
    the first stage waits 3(p-1) slots for its first backward, and its 3m slots of work fill the rest."""
    for m in range(1, p):
        schedule = one_f_one_b(p, m)
        peaks = peak_in_flight(schedule)
        for r in range(p):
            assert num_warmup("1f1b", p, 1, m, r) == min(p - r - 1, m)
            assert peaks[r] == min(p - r, m) == schedule.in_flight_bound(r)
        result = dry_run(schedule, 1.0, 2.0)
        assert result.makespan == 3 * (m + p - 1), (p, m, result.makespan)
        assert all(b == pytest.approx((p - 1) / m) for b in result.bubble.values())


def test_wrapped_grid_fits_the_width_and_keeps_every_action() -> None:
    """A long lowered grid cut into blocks: every line within the width, every action once, in order."""
    schedule = lower(interleaved_1f1b(4, 2, 8))
    for width in (60, 100, 140):
        text = schedule.wrapped(width)
        assert max(len(line) for line in text.splitlines()) <= width
        rows = {s: [] for s in range(4)}
        for line in text.splitlines()[1:]:
            label, _, rest = line.partition(":")
            if label.startswith("stage"):
                rows[int(label.split()[1])] += [w for w in rest.split() if w != "..."]
        assert rows == {s: [str(a) for a in acts] for s, acts in schedule.actions.items()}
