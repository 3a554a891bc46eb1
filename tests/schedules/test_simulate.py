"""Tier (a): the schedule simulator (eager and posted sends) against the closed forms and
schedules.dry_run (batched sends), and the planner's use of it."""

from __future__ import annotations

import random
import xml.etree.ElementTree as ET
from fractions import Fraction
from html import escape

import pytest

from autopar.planning.cost.calibration import PAPER_RUNS
from autopar.planning.cost.pipeline_timeline import eager_timeline, lowered_timeline, runtime_schedule
from autopar.planning.cost.step_timelines import estimate_with_timeline
from autopar.planning.drawing.timeline import timeline_svg, timeline_text
from autopar.schedules import Action, Sends, dry_run, generate, in_flight_bound, lower, peak_in_flight
from autopar.schedules import simulate as run_schedule


def simulate(schedule, cost_f=1.0, cost_b=2.0, comm=0.0):
    """The planner's model: a compute-only schedule with eager, blocking sends."""
    return run_schedule(schedule, cost_f, cost_b, comm, sends=Sends.EAGER)


def simulate_lowered(schedule, cost_f=1.0, cost_b=2.0, comm=0.0):
    """autopar's runtime: a lowered schedule with posted, non-blocking sends."""
    return run_schedule(schedule, cost_f, cost_b, comm, sends=Sends.POSTED)

GRID = [
    ("gpipe", 4, 1, 4), ("gpipe", 3, 1, 7), ("1f1b", 2, 1, 2), ("1f1b", 4, 1, 8), ("1f1b", 8, 1, 11),
    ("interleaved", 2, 2, 4), ("interleaved", 4, 2, 8), ("interleaved", 4, 3, 12), ("interleaved", 3, 4, 6),
    ("interleaved", 8, 2, 16),
]


@pytest.mark.parametrize("name,p,v,m", GRID)
def test_uniform_bubble_is_p_minus_1_over_v_m(name, p, v, m):
    # integer costs: the simulated times are exact in floating point
    sim = simulate(generate(name, p, v, m), 1.0, 2.0)
    assert sim.bubble == pytest.approx((p - 1) / (v * m), abs=1e-12)
    assert sim.step_time == pytest.approx((v * m + p - 1) * 3.0)
    assert all(b == pytest.approx((p - 1) / (v * m)) for b in sim.bubble_per_stage.values())


@pytest.mark.parametrize("name,p,v,m", GRID)
def test_matches_schedules_dry_run_without_communication(name, p, v, m):
    rng = random.Random(p * 100 + v * 10 + m)  # fixed seed per case
    cf = {c: Fraction(rng.randint(1, 9), 4) for c in range(p * v)}
    cb = {c: Fraction(rng.randint(4, 19), 4) for c in range(p * v)}
    sched = generate(name, p, v, m)
    ours = simulate(sched, lambda a: float(cf[a.chunk]), lambda a: float(cb[a.chunk]))
    ref = dry_run(sched, lambda a: cf[a.chunk], lambda a: cb[a.chunk])
    assert ours.step_time == pytest.approx(float(ref.makespan), rel=1e-12)
    assert ours.busy == {s: pytest.approx(float(b)) for s, b in ref.busy.items()}


@pytest.mark.parametrize("name,p,v,m", GRID)
def test_peak_in_flight_matches_schedule_and_closed_form(name, p, v, m):
    sim = simulate(generate(name, p, v, m), 1.0, 2.0)
    assert sim.peak_in_flight == peak_in_flight(sim.schedule)
    assert [sim.peak_in_flight[r] for r in range(p)] == [in_flight_bound(name, p, v, m, r) for r in range(p)]


def test_communication_is_on_the_critical_path():
    p, m, c = 4, 8, 0.25
    base = simulate(generate("1f1b", p, 1, m), 1.0, 2.0)
    sim = simulate(generate("1f1b", p, 1, m), 1.0, 2.0, comm=c)
    # microbatch 0 crosses p-1 links forward and p-1 back; the steady state pays
    # one blocking send after every forward and every backward of a middle stage
    assert sim.step_time >= base.step_time + 2 * (p - 1) * c
    assert sim.step_time <= (m + p - 1) * (3.0 + 2 * c) + 1e-9
    sends = [e for e in sim.events[1] if e.kind == "comm"]
    assert len(sends) == 2 * m and all(e.end - e.start == pytest.approx(c) for e in sends)
    assert sim.comm[1] == pytest.approx(2 * m * c)
    assert sim.comm[0] == pytest.approx(m * c)  # stage 0 only sends forward


def test_lm_head_on_the_last_stage_unbalances_the_pipeline():
    even = eager_timeline("1f1b", 4, 1, 8, 1.0, 2.0, 0.0)
    heavy = eager_timeline("1f1b", 4, 1, 8, 1.0, 2.0, 0.0, last_extra=(0.5, 1.0))
    # the last stage is the bottleneck: every microbatch pays its extra 1.5
    assert heavy.step_time == pytest.approx(even.step_time + 8 * 1.5)
    assert heavy.bubble_per_stage[0] > heavy.bubble_per_stage[3]


@pytest.mark.parametrize("run", [r for r in PAPER_RUNS if r.p > 1], ids=lambda r: r.model)
def test_simulated_estimate_close_to_closed_form(run):
    closed = run.predict(simulate=False)
    est, sim = estimate_with_timeline(run.spec, run.cluster(), run.layout())
    assert est.simulated and sim.schedule.v == run.v and sim.schedule.m == closed.m
    assert est.t_pipeline == pytest.approx(sim.step_time)
    assert est.t_iter == pytest.approx(closed.t_iter, rel=0.01)
    assert est.memory.total == pytest.approx(closed.memory.total, rel=1e-9)


@pytest.mark.parametrize("name,p,v,m", GRID)
@pytest.mark.parametrize("lowering", [(1, 1), (1, 2)], ids=["lowered-1-1", "lowered-1-2"])
def test_lowered_matches_schedules_dry_run_without_transfer_time(name, p, v, m, lowering):
    rng = random.Random(p * 100 + v * 10 + m)
    cf = {c: Fraction(rng.randint(1, 9), 4) for c in range(p * v)}
    cb = {c: Fraction(rng.randint(4, 19), 4) for c in range(p * v)}
    sched = lower(generate(name, p, v, m), *lowering)
    ours = simulate_lowered(sched, lambda a: float(cf[a.chunk]), lambda a: float(cb[a.chunk]))
    # sends never block and a receive is waited for only by its consumer, so without transfer
    # time the runtime reaches the dependency bound: the compute-only schedule's dry run
    ref = dry_run(generate(name, p, v, m), lambda a: cf[a.chunk], lambda a: cb[a.chunk])
    assert ours.lowered and ours.step_time == pytest.approx(float(ref.makespan), rel=1e-12)
    assert ours.busy == {s: pytest.approx(float(b)) for s, b in ref.busy.items()}
    assert ours.peak_in_flight == peak_in_flight(sched)


def test_lowered_exchanges_wait_and_transfer():
    sched = runtime_schedule("1f1b", 2, 1, 4)
    base = simulate_lowered(sched, 1.0, 2.0)
    sim = simulate_lowered(sched, 1.0, 2.0, comm=0.25)
    # microbatch 0 crosses the link forward and back: at least 2 transfers on the critical path
    assert sim.step_time >= base.step_time + 2 * 0.25
    comm = [e for e in sim.events[1] if e.kind == "comm"]
    assert comm and all(e.name.startswith("RF1.") for e in comm)  # the last stage only receives activations
    assert sim.comm[1] == pytest.approx(sum(e.end - e.start for e in comm))
    # stage 1 posts its first receive at 0 and waits for stage 0's forward
    first = sim.events[1][0]
    assert first.kind == "wait" and first.start == 0 and first.end == pytest.approx(1.0)
    assert sim.idle[1] == pytest.approx(sim.step_time - sim.busy[1] - sim.comm[1])
    with pytest.raises(ValueError, match="lower it first"):
        simulate_lowered(generate("1f1b", 2, 1, 4))


def test_one_simulator_three_send_behaviours():
    """dry_run is the batched simulation; the three behaviours agree without transfer time on a
    compute-only schedule, and each refuses the schedule or costs it cannot time."""
    sched = generate("interleaved", 2, 2, 4)
    batched = run_schedule(sched, Fraction(1), Fraction(2), sends="batched")
    ref = dry_run(sched, Fraction(1), Fraction(2))
    assert batched.sends is Sends.BATCHED and batched.step_time == ref.makespan == 27
    assert batched.start == ref.start and batched.end == ref.end
    eager = run_schedule(sched, Fraction(1), Fraction(2), sends="eager")
    assert eager.step_time == batched.step_time and eager.start == batched.start  # exact: Fractions throughout
    assert simulate_lowered(lower(sched), Fraction(1), Fraction(2)).step_time == 27
    with pytest.raises(ValueError, match="lower it first"):
        run_schedule(sched, sends="posted")
    with pytest.raises(ValueError, match="eager sends are implicit"):
        run_schedule(lower(sched), sends="eager")
    with pytest.raises(ValueError, match="take no transfer time"):
        run_schedule(sched, comm=0.5, sends="batched")
    with pytest.raises(ValueError, match="'sideways' is not a valid Sends"):
        run_schedule(sched, sends="sideways")


def test_batched_exchanges_wait_where_posted_ones_do_not():
    """Documented in lower(): with B = 2F the lowered interleaved schedule loses bubble when
    each batch of sends/receives is waited for whole, and keeps it when sends are posted."""
    low = lower(generate("interleaved", 2, 2, 4))
    batched = run_schedule(low, 1, 2, sends="batched")
    posted = run_schedule(low, 1, 2, sends="posted")
    assert dry_run(low, 1, 2).bubble_fraction == Fraction(7, 24)
    assert Fraction(batched.step_time - batched.busy[0], batched.busy[0]) == Fraction(7, 24)
    assert posted.bubble == pytest.approx(1 / 8)
    # the time lost is the batches' waits for their partners, each named by the batch's actions
    waits = [e for evs in batched.events.values() for e in evs if e.kind == "wait"]
    assert waits and all(Action.parse(x).is_comm for e in waits for x in e.name.split())
    assert all(batched.idle[s] == sum(e.end - e.start for e in batched.events[s] if e.kind == "wait")
               + (batched.step_time - batched.end[s][-1]) for s in batched.events)


def test_a_posted_schedule_that_cannot_finish_names_what_it_waits_for():
    from autopar.schedules import ScheduleError, parse_grid

    # stage 1 consumes microbatch 1's activation before it posts that receive
    broken = parse_grid("custom p=2 v=1 m=2\n"
                        "stage 0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 RB0.1<1 B0.1\n"
                        "stage 1: RF1.0<0 F1.0 F1.1 RF1.1<0 B1.0 SB1.0>0 B1.1 SB1.1>0")
    with pytest.raises(ScheduleError, match=r"stage 1 waits at F1\.1 for RF1\.1<0 \(stage 1 step 3\) to finish"):
        simulate_lowered(broken)


def test_simulated_and_measured_steps_share_one_event():
    from autopar.runtime.engine.timeline import Event as MeasuredEvent
    from autopar.runtime.engine.timeline import write_chrome_trace
    from autopar.schedules import Event

    assert MeasuredEvent is Event
    sim = simulate_lowered(runtime_schedule("1f1b", 2, 1, 2), 1.0, 2.0, comm=0.25)
    events = [e for evs in sim.events.values() for e in evs]
    assert {e.kind for e in events} == {"F", "B", "comm", "wait"}
    assert all(e.action is not None for e in events if e.kind in ("F", "B"))
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".json") as fh:
        write_chrome_trace(events, fh.name)
        trace = json.load(open(fh.name))["traceEvents"]
    assert sorted(x["name"] for x in trace if x.get("ph") == "X") == sorted(e.name for e in events)


def test_runtime_keeps_the_bubble_where_f_and_b_differ():
    """With B = 2F the runtime's lowered schedules keep the ideal bubble: sends do not block
    and receives are waited for by their consumer, as in the planner's eager model."""
    for name, p, v, m in (("1f1b", 4, 1, 8), ("gpipe", 4, 1, 8)):
        assert simulate_lowered(runtime_schedule(name, p, v, m), 1.0, 2.0).bubble == pytest.approx((p - 1) / m)
    low = lowered_timeline("interleaved", 4, 2, 8, 1.0, 2.0, 0.0)
    eager = eager_timeline("interleaved", 4, 2, 8, 1.0, 2.0, 0.0)
    assert eager.bubble == pytest.approx(3 / 16) and low.bubble == pytest.approx(3 / 16)


def test_timeline_pictures():
    sim = simulate(generate("interleaved", 2, 2, 4), 1.0, 2.0, comm=0.1)
    text = timeline_text(sim, width=80).plain
    rows = [line for line in text.splitlines() if line.startswith("stage ")]
    assert len(rows) == 2 and all(len(r) == len("stage 1 ") + 80 for r in rows)
    assert "·" in rows[1]  # the bubble is visible
    svg = timeline_svg(sim, title="t")
    root = ET.fromstring(svg)  # well-formed
    titles = [el.text for el in root.iter("{http://www.w3.org/2000/svg}title")]
    assert sum(1 for t in titles if t.startswith(("F", "B"))) == 2 * 2 * 2 * 4  # F and B of 4 chunks x 4 mb
    assert sum(1 for t in titles if t.startswith("bubble")) == 2
    assert "F3.2" in svg and "stage 1" in svg


def test_lowered_timeline_picture():
    sim = simulate_lowered(runtime_schedule("interleaved", 2, 2, 4), 1.0, 2.0, comm=0.1)
    svg = timeline_svg(sim, title="t", notes=("a note",))
    root = ET.fromstring(svg)
    titles = [el.text for el in root.iter("{http://www.w3.org/2000/svg}title")]
    assert sum(1 for t in titles if t.startswith(("F", "B"))) == 2 * 2 * 2 * 4
    assert any(t.startswith("waiting for the partner of") for t in titles)
    assert any(t.startswith("transfer S") or t.startswith("transfer R") for t in titles)
    assert "lowered" in svg and "a note" in svg and "stage 1" in svg
    # wide enough that the shortest box (F = 1 of a 20.x step) is about 30 px
    assert float(root.get("width")) >= 30 * sim.step_time
    text = timeline_text(sim, width=80).plain
    assert "~" in text


def test_cli_simulate_writes_svg(tmp_path, capsys):
    from autopar.cli import main
    from autopar.planning.quantities import rate

    path = tmp_path / "step.svg"
    args = ["simulate", "--pp", "4", "--vp", "2", "--microbatches", "8", "--svg", str(path), "--width", "60"]
    lowered = simulate_lowered(runtime_schedule("interleaved", 4, 2, 8))
    eager = simulate(generate("interleaved", 4, 2, 8))
    assert lowered.bubble == eager.bubble == pytest.approx(3 / 16)  # (p-1)/(v m) both ways
    assert lowered.step_time == eager.step_time == (2 * 8 + 3) * 3  # F = 1, B = 2

    def words(text: str) -> str:  # rich wraps long lines at the console's width
        return " ".join(text.split())

    drawn_lowered = (f"interleaved p=4 v=2 m=8 (lowered: non-blocking sends, receives awaited by their consumer, "
                     f"as autopar's runtime runs it): step {lowered.step_time:.4g} units, bubble {lowered.bubble:.1%}")
    drawn_eager = (f"interleaved p=4 v=2 m=8 (eager sends (the planner's model)): step {eager.step_time:.4g} units, "
                   f"bubble {eager.bubble:.1%}")
    assert main(args) == 0
    out = words(capsys.readouterr().out)
    assert drawn_lowered in out  # the runtime's schedule is drawn
    assert f"eager sends (the planner model): step {eager.step_time:.4g} units, bubble {eager.bubble:.1%}" in out
    svg = path.read_text()
    ET.fromstring(svg)
    assert escape(drawn_lowered) in svg and "waiting for the partner of RF" in svg and ">F7.3<" in svg
    assert main(args + ["--eager"]) == 0
    out = words(capsys.readouterr().out)
    assert drawn_eager in out
    assert f"lowered schedule (autopar runtime): step {lowered.step_time:.4g} units, bubble {lowered.bubble:.1%}" in out
    svg = path.read_text()
    assert escape(drawn_eager) in svg and "waiting for the partner of" not in svg and ">F7.3<" in svg


def test_cli_simulate_model_layout(tmp_path, capsys):
    from autopar.cli import main
    from autopar.planning.quantities import rate

    path = tmp_path / "step.svg"
    args = ["simulate", "--model", "gpt-39b", "--gpus", "512", "--batch", "1536", "--tp", "8", "--pp", "2",
            "--vp", "4", "--micro-batch", "4", "--svg", str(path), "--width", "60"]
    assert main(args) == 0
    out = capsys.readouterr().out
    est = PAPER_RUNS[4].predict()
    assert f"{rate(est.tflops_per_gpu * 1e12, 'FLOP', 4)}/GPU" in out  # the planner's number, beside the runtime's
    assert f"{est.tflops_per_gpu:.1f} TFLOP/s/GPU" in out  # 4 digits: the paper's 0.1 TFLOP/s
    assert "lowered schedule (autopar's runtime)" in out
    ET.parse(path)
