"""A measured run laid beside its prediction: per-action costs from a run's events, the same
schedule simulated with them, and the step times compared.

Fast tests (no process group) take costs from synthetic steps with known answers: a step
the simulator itself produced, written the way the engine records one (a batch of
sends/receives is posted, a consumer's wait for its tensor is one ``wait`` event), must give
back the costs it was simulated with. The multi-process test trains a reference GPT on two
gloo ranks (1F1B and interleaved), writes the trace, and checks that the simulator fed the
run's own costs predicts the measured median step within 15%.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from autopar.core.mesh import MeshShape
from autopar.planning.cost.pipeline_timeline import runtime_schedule
from autopar.planning.measured.action_costs import (BLOCKED_S, action_costs, compute_samples, received_messages,
                                                    transfer_pairs)
from autopar.planning.measured.comparison import compare
from autopar.planning.measured.trace_reader import read_trace
from autopar.runtime.engine.timeline import write_chrome_trace
from autopar.schedules import Action, Event, Kind, Sends, SimResult, simulate
from autopar.schedules.trace_format import METADATA_FIELDS, METADATA_KEY

PP2 = MeshShape(pp=2)


def _as_measured(sim: SimResult, offset: float = 0.0) -> dict[int, list[Event]]:
    """A simulated step as the engine records one: each batch of sends/receives an event (here
    instant, at the moment it is posted), and an F or B's wait for its received tensor (the
    simulator's ``wait`` then ``comm``) one ``wait`` event."""
    out: dict[int, list[Event]] = {}
    for s, acts in sim.schedule.actions.items():
        events = [e for e in sim.events[s] if e.kind in ("F", "B", "W")]
        t = 0
        while t < len(acts):
            if acts[t].is_comm:
                u = t
                while u < len(acts) and acts[u].is_comm:
                    u += 1
                at = sim.start[s][t]
                events.append(Event(s, "comm", " ".join(map(str, acts[t:u])), at, at))
                t = u
            else:
                t += 1
        waits: dict[str, list[Event]] = {}
        for e in sim.events[s]:
            if e.kind in ("wait", "comm"):
                waits.setdefault(e.name, []).append(e)
        events += [Event(s, "wait", name, parts[0].start, parts[-1].end) for name, parts in waits.items()]
        out[s] = sorted((Event(x.rank, x.kind, x.name, x.start + offset, x.end + offset) for x in events),
                        key=lambda x: (x.start, x.kind != "comm"))
    return out


def _known_costs(name: str, p: int, v: int, m: int, comm: float) -> SimResult:
    """A step simulated with forward 1 + chunk / 2 and backward twice that, ``comm`` per message."""
    return simulate(runtime_schedule(name, p, v, m), lambda a: 1.0 + a.chunk / 2, lambda a: 2.0 + a.chunk,
                    comm, sends=Sends.POSTED)


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved", 2)])
def test_costs_of_a_simulated_step_are_the_costs_it_was_simulated_with(name, v):
    sim = _known_costs(name, 2, v, 4, comm=0.25)
    costs = action_costs([_as_measured(sim)], PP2, sim.schedule.chunk_stages)
    assert costs.compute == {(k, c): (1.0 + c / 2) * (1 if k == "F" else 2) for k in "FB" for c in range(2 * v)}
    # every message whose consumer blocked timed the transfer exactly; the rest are bounded by it
    assert costs.blocked > 0
    assert all(t == pytest.approx(0.25) for t in costs.transfer.values()), costs.transfer
    again = simulate(sim.schedule, costs.cost_f, costs.cost_b, costs.comm, sends=Sends.POSTED)
    assert again.step_time == pytest.approx(sim.step_time)


def _zero_bubble_costs(name: str, p: int, v: int, m: int, comm: float) -> SimResult:
    """A zero-bubble step simulated with forward 1 + chunk / 2, input gradient (B) 1.25 + chunk / 2
    and weight gradient (W) 0.75 + chunk / 4, ``comm`` per message."""
    return simulate(runtime_schedule(name, p, v, m), lambda a: 1.0 + a.chunk / 2,
                    lambda a: 2.0 + 3 * a.chunk / 4, comm, sends=Sends.POSTED, cost_w=lambda a: 0.75 + a.chunk / 4)


@pytest.mark.parametrize("name, v", [("zb-h1", 1), ("zbv", 2)])
def test_costs_of_a_zero_bubble_step_give_w_apart_and_pair_the_placements_stages(name, v):
    sim = _zero_bubble_costs(name, 2, v, 4, comm=0.25)
    stages = sim.schedule.chunk_stages
    costs = action_costs([_as_measured(sim)], PP2, stages)
    want = {("F", c): 1.0 + c / 2 for c in range(2 * v)} | {("B", c): 1.25 + c / 2 for c in range(2 * v)} \
        | {("W", c): 0.75 + c / 4 for c in range(2 * v)}
    assert costs.compute == pytest.approx(want) and costs.splits_backward
    # the simulator's cost_b is the whole backward, B + W
    assert costs.cost_b(Action(Kind.B, 0, 0)) == pytest.approx(2.0)
    assert costs.simulate(sim.schedule).step_time == pytest.approx(sim.step_time)
    # every message went between the stages that hold its producer's and its consumer's chunks (under
    # ZB-V chunks 1 and 2 share stage 1 and 0 and 3 stage 0: the hop 1 -> 2 sends nothing)
    pairs = transfer_pairs([_as_measured(sim)], PP2, stages)
    want_pairs = {("F", c): {(stages[c], stages[c + 1])} for c in range(2 * v - 1) if stages[c] != stages[c + 1]}
    want_pairs |= {("B", c): {(stages[c], stages[c - 1])} for c in range(1, 2 * v) if stages[c] != stages[c - 1]}
    assert pairs == want_pairs
    if name == "zbv":
        assert pairs == {("F", 0): {(0, 1)}, ("F", 2): {(1, 0)}, ("B", 3): {(0, 1)}, ("B", 1): {(1, 0)}}
        with pytest.raises(ValueError, match="waited for RF3.0, but the step has no batch posting RF3.0<0"):
            action_costs([_as_measured(sim)], PP2, (0, 1, 0, 1))  # the interleaved c % p is not this run's


def test_a_measured_step_without_its_schedules_w_is_refused():
    sim = _zero_bubble_costs("zb-h1", 2, 1, 4, comm=0.0)
    no_w = {r: [e for e in evs if e.kind != "W"] for r, evs in _as_measured(sim).items()}
    with pytest.raises(ValueError, match="splits its backwards but the measured step has no W actions"):
        action_costs([no_w], PP2, (0, 1)).simulate(sim.schedule)


def test_a_failed_trace_write_leaves_the_file_that_was_there(tmp_path):
    path = tmp_path / "trace.json"
    write_chrome_trace([Event(0, "F", "F0.0", 0.0, 1.0)], str(path))
    before = path.read_text()
    with pytest.raises(ValueError, match=r"events of unknown kind \['X'\]"):
        write_chrome_trace([Event(0, "X", "X0.0", 0.0, 1.0)], str(path))
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]
    with pytest.raises(ValueError):
        write_chrome_trace([Event(0, "X", "X0.0", 0.0, 1.0)], str(tmp_path / "new.json"))
    assert not (tmp_path / "new.json").exists()


def test_occupancy_includes_the_batch_posted_after_an_action():
    events = [Event(0, "F", "F0.0", 0.0, 1.0), Event(0, "comm", "SF0.0>1", 1.0, 1.2),
              Event(0, "F", "F0.1", 1.2, 2.2), Event(0, "comm", "SF0.1>1 RB0.0<1", 2.2, 2.3),
              Event(0, "wait", "RB0.0", 2.3, 3.0), Event(0, "B", "B0.0", 3.0, 5.0)]
    got = compute_samples(events)
    assert got == pytest.approx({("F", 0, 0): 1.2, ("F", 0, 1): 1.1, ("B", 0, 0): 2.0})


def test_a_receives_wait_splits_into_the_peers_lateness_and_the_transfer():
    step = {0: [Event(0, "F", "F0.0", 0.0, 1.0), Event(0, "comm", "SF0.0>1", 1.0, 1.2),
                Event(0, "F", "F0.1", 1.2, 1.4), Event(0, "comm", "SF0.1>1", 1.4, 1.5)],
            1: [Event(1, "comm", "RF1.0<0", 0.0, 0.1), Event(1, "wait", "RF1.0", 0.1, 1.5),
                Event(1, "F", "F1.0", 1.5, 1.9), Event(1, "comm", "RF1.1<0", 1.9, 2.0),
                Event(1, "wait", "RF1.1", 2.0, 2.0 + BLOCKED_S / 10), Event(1, "F", "F1.1", 2.0, 2.4)]}
    first, second = received_messages(step, PP2, (0, 1))
    assert (first.name, first.produced, first.microbatch) == ("RF1.0", ("F", 0), 0)
    assert first.blocked and first.posted == pytest.approx(1.2)
    assert first.peer_late == pytest.approx(1.1) and first.in_flight == pytest.approx(0.3)
    assert first.since_posted == pytest.approx(0.3)
    # already there when asked: arrived between both posted (2.0) and asked (2.0): a bound only
    assert not second.blocked and second.since_posted == pytest.approx(0.0)
    costs = action_costs([step], PP2, (0, 1))
    assert costs.transfer == {("F", 0): pytest.approx(0.3)} and (costs.blocked, costs.received) == (1, 2)


def test_a_step_without_its_partners_batch_is_refused():
    step = {0: [Event(0, "F", "F0.0", 0.0, 1.0)],
            1: [Event(1, "comm", "RF1.0<0", 0.0, 0.1), Event(1, "wait", "RF1.0", 0.1, 1.5)]}
    with pytest.raises(ValueError, match=r"rank 1 waited for RF1.0, but .* SF0.0>1 on rank 0"):
        received_messages(step, PP2, (0, 1))


def _metadata(schedule, steps) -> dict:
    return {"format": 1, "schedule": schedule.name, "p": schedule.p, "v": schedule.v, "m": schedule.m,
            "grid": schedule.format_grid(), "tp": 1, "dp": 1, "pp": schedule.p, "world": schedule.p,
            "stage_of_rank": list(range(schedule.p)), "message_bytes": {"forward": {"0": 1024}}, "steps": steps}


def _synthetic_trace(path, comms=(0.25, 0.25, 0.5)) -> None:
    """Three steps of 1F1B p=2 m=4, one after the other, written as the engine writes them."""
    events, step_of, t = [], [], 0.0
    for k, comm in enumerate(comms):
        sim = _known_costs("1f1b", 2, 1, 4, comm)
        for evs in _as_measured(sim, offset=t).values():
            events += evs
            step_of += [k] * len(evs)
        t += float(sim.step_time) + 1.0
    write_chrome_trace(events, str(path), steps=step_of, metadata=_metadata(sim.schedule, list(range(len(comms)))))


def test_trace_round_trip_and_the_comparison(tmp_path):
    path = tmp_path / "step.json"
    _synthetic_trace(path)
    run = read_trace(str(path))
    assert run.schedule == runtime_schedule("1f1b", 2, 1, 4) and sorted(run.steps) == [0, 1, 2]
    assert run.message_bytes["forward"] == {0: 1024}
    comp = compare(run)
    assert [s.step for s in comp.per_step] == [1, 2]
    for s in comp.per_step:  # a step simulated with its own costs is itself
        assert s.predicted == pytest.approx(s.measured) and s.replayed == pytest.approx(s.measured)
    assert comp.measured_step == pytest.approx(statistics.median(s.measured for s in comp.per_step))
    assert f"{comp.ratio:.3f}" in comp.summary()
    measured = comp.measured_events()
    assert min(e.start for evs in measured.values() for e in evs) == 0.0
    assert {r: sorted(e.name for e in evs if e.kind in "FB") for r, evs in comp.predicted_events().items()} == \
           {r: sorted(e.name for e in evs if e.kind in "FB") for r, evs in measured.items()}


def test_bad_traces_are_refused_with_the_fix(tmp_path):
    plain = tmp_path / "plain.json"
    write_chrome_trace([Event(0, "F", "F0.0", 0.0, 1.0)], str(plain))
    with pytest.raises(ValueError, match=r"no \"autopar\" object of format 1 .*engine.write_trace\(path, steps=k\)"):
        read_trace(str(plain))
    with pytest.raises(ValueError, match="cannot read the trace"):
        read_trace(str(tmp_path / "missing.json"))
    one = tmp_path / "one.json"
    _synthetic_trace(one, comms=(0.25,))
    with pytest.raises(ValueError, match=r"holds 1 step\(s\) and the first 1 are a warm-up"):
        compare(read_trace(str(one)))


def test_cli_draws_measured_above_predicted(tmp_path, capsys):
    from autopar.cli import main

    path, svg = tmp_path / "step.json", tmp_path / "both.svg"
    _synthetic_trace(path)
    assert main(["simulate", "--measured", str(path), "--svg", str(svg)]) == 0
    picture = svg.read_text()
    assert picture.count(">rank 0 (predicted)<") == 1 and picture.count(">rank 1<") == 1
    assert "predicted / measured = " in picture
    both = json.loads((tmp_path / "step-vs-predicted.json").read_text())["traceEvents"]
    rows = {x["args"]["name"] for x in both if x["name"] == "process_name"}
    assert rows == {"rank 0", "rank 1", "rank 0 (predicted)", "rank 1 (predicted)"}
    out = capsys.readouterr().out
    assert "predicted / measured" in out
    assert max(len(line) for line in out.splitlines()) <= 120  # piped: 120 columns, the step table whole
    assert _table_steps(out) == [1, 2]


def _table_steps(out: str) -> list[int]:
    """The step numbers of the per-step table ``autopar simulate --measured`` prints."""
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("──"))
    steps = []
    for line in lines[rule + 1:]:
        if not line.split() or not line.split()[0].isdigit():
            return steps
        steps.append(int(line.split()[0]))
    return steps


# ---------------------------------------------------------------------------- on two ranks

STEPS, M = 6, 8
CASES = (1, 2)  # virtual stages: 1F1B, interleaved 1F1B
RUNS = tuple((f"v{v}", None, v) for v in CASES)  # (name, schedule (None: the default for v), virtual stages)
TRACE_MODEL = dict(vocab=256, d_model=96, n_head=4, seq=32)


def _traced_program(schedule, v, m, vocab, d_model, n_head, seq):
    """The 4-layer GPT compiled for pp=2 (once per process: the ranks inherit the test process's), and its
    batch of ``2 * m`` sequences (inputs, targets)."""
    from helpers import compiled

    from autopar.reference.models import build

    torch.manual_seed(0)
    model = build("gpt", vocab_size=vocab, seq_len=seq, n_layer=4, n_head=n_head, d_model=d_model)
    tokens = torch.randint(0, vocab, (2 * m, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    program = compiled(model, pp=2, virtual_stages=v, microbatches=m, schedule=schedule, world_size=2,
                       example_inputs=(x[:2],), example_targets=y[:2])
    return program, (x, y)


def _train_and_trace(directory: str, runs=RUNS, m: int = M, steps: int = STEPS,
                     model: dict = TRACE_MODEL) -> list[str]:
    """Train a 4-layer GPT (``model``: its vocabulary, width, heads and sequence length) on pp=2 for each
    (name, schedule (None: the default for v), virtual stages) of ``runs`` and write its last ``steps`` steps
    as ``{directory}/{name}.json``."""
    paths = []
    for name, schedule, v in runs:
        program, (x, y) = _traced_program(schedule, v, m, **model)  # inherited from the test process
        engine = program.materialize()
        for _ in range(steps):
            engine.train_step(x, y)
        paths.append(f"{directory}/{name}.json")
        engine.write_trace(paths[-1], steps=steps)
    return paths


@pytest.fixture(scope="module")
def every_trace(tmp_path_factory):
    """Both spawns' traces from one spawn of the 2 ranks: (1F1B and interleaved, zero-bubble)."""
    from helpers import spawn_ranks

    for _, schedule, v in RUNS:  # compile once here: the ranks inherit the programs
        _traced_program(schedule, v, M, **TRACE_MODEL)
    for name, v in ZB_CASES:
        _traced_program(name, v, ZB_M, **ZB_MODEL)
    return spawn_ranks(_train_every_trace, 2, str(tmp_path_factory.mktemp("measured")))[0]


@pytest.fixture(scope="module")
def traces(every_trace):
    return every_trace[0]


@pytest.mark.multiprocess
def test_trace_carries_every_step_and_the_schedule(traces):
    for v, path in zip(CASES, traces):
        run = read_trace(path)
        assert (run.schedule.name, run.schedule.p, run.schedule.v, run.schedule.m) == \
               ("interleaved" if v > 1 else "1f1b", 2, v, M)
        assert run.schedule == runtime_schedule(run.schedule.name, 2, v, M)
        assert sorted(run.steps) == list(range(STEPS)) and all(sorted(s) == [0, 1] for s in run.steps.values())
        for step in run.steps.values():
            for events in step.values():
                assert len(compute_samples(events)) == 2 * v * M  # every F and B of the rank, once
        assert run.message_bytes["forward"][0] == 2 * 32 * 96 * 4  # one microbatch's fp32 activations
        assert set(json.loads(open(path).read())[METADATA_KEY]) == set(METADATA_FIELDS)  # the format's fields


@pytest.mark.multiprocess
def test_simulator_fed_the_runs_costs_predicts_the_measured_step(traces):
    # The simulator, fed each action's own measured time (the replay), gives the measured step
    # within 15%: what it adds is only its model of the dependencies and transfers. Each step
    # simulated with that step's mean costs per (stage, chunk, kind) is checked more loosely (35%):
    # on a 2-core machine shared with other work a rank descheduled for tens of ms inside one
    # action lands in one microbatch, which the pooled costs spread over all of them. Medians over
    # steps, the first (a warm-up) left out.
    for path in traces:
        comp = compare(read_trace(path))
        assert len(comp.per_step) == STEPS - 1
        assert abs(comp.replay_ratio - 1) <= 0.15, comp.summary()
        assert abs(comp.per_step_ratio - 1) <= 0.35, comp.summary()


# ------------------------------------------------------------ zero-bubble schedules on two ranks

ZB_CASES = (("zbv", 2), ("zb-h1", 1))
ZB_STEPS, ZB_M = 3, 4
ZB_MODEL = dict(vocab=128, d_model=32, n_head=2, seq=16)


def _train_zero_bubble_and_trace(directory: str) -> list[str]:
    return _train_and_trace(directory, tuple((name, name, v) for name, v in ZB_CASES), m=ZB_M, steps=ZB_STEPS,
                            model=ZB_MODEL)


def _train_every_trace(directory: str) -> tuple[list[str], list[str]]:
    return _train_and_trace(directory), _train_zero_bubble_and_trace(directory)


@pytest.mark.multiprocess
def test_zero_bubble_traces_are_written_and_simulated(every_trace, tmp_path_factory, capsys):
    from autopar.cli import main

    paths = every_trace[1]
    for (name, v), path in zip(ZB_CASES, paths):
        run = read_trace(path)
        stages = run.schedule.chunk_stages
        assert run.schedule == runtime_schedule(name, 2, v, ZB_M) and sorted(run.steps) == list(range(ZB_STEPS))
        assert json.loads(open(path).read())["autopar"]["chunk_stages"] == list(stages)
        # message sizes where a message goes: not at ZB-V's turn, where both chunks share a stage
        assert sorted(run.message_bytes["forward"]) == [c for c in range(2 * v - 1) if stages[c] != stages[c + 1]]
        assert sorted(run.message_bytes["backward"]) == [c for c in range(1, 2 * v) if stages[c] != stages[c - 1]]
        for step in run.steps.values():
            for events in step.values():  # every F, B and W of the rank, once
                assert sorted({k[0] for k in compute_samples(events)}) == ["B", "F", "W"]
                assert len(compute_samples(events)) == 3 * v * ZB_M
        comp = compare(run)
        assert {k for k in comp.costs.compute if k[0] == "W"} == {("W", c) for c in range(2 * v)}
        assert all(t > 0 for t in comp.costs.compute.values())
        # each message went from the stage of its producer's chunk to the stage of its consumer's
        pairs = transfer_pairs(list(run.steps.values()), run.shape, stages)
        want = {("F", c): {(stages[c], stages[c + 1])} for c in range(2 * v - 1) if stages[c] != stages[c + 1]}
        want |= {("B", c): {(stages[c], stages[c - 1])} for c in range(1, 2 * v) if stages[c] != stages[c - 1]}
        assert pairs == want
        svg = tmp_path_factory.mktemp("pictures") / f"{name}.svg"
        assert main(["simulate", "--measured", path, "--svg", str(svg)]) == 0
        out = capsys.readouterr().out
        assert "predicted / measured" in out
        lines = out.splitlines()
        head = next(i for i, line in enumerate(lines) if line.split()[:5] == ["chunk", "stage", "F", "B", "W"])
        table = [line.split() for line in lines[head + 2:head + 2 + 2 * v]]
        for c, row in enumerate(table):  # chunk, stage, F, B, W, send F, send B: W's cost printed
            assert row[:2] == [str(c), str(stages[c])] and float(row[4]) == pytest.approx(
                comp.costs.compute[("W", c)] * 1e3, abs=1e-3)
            assert (row[5] == "-") == (c == 2 * v - 1 or stages[c] == stages[c + 1])  # no message, no send
        picture = svg.read_text()
        assert "weight gradient (W)" in picture and ">rank 1 (predicted)<" in picture
        both = json.loads(open(path.replace(".json", "-vs-predicted.json")).read())["traceEvents"]
        # W events in both rows of each rank, measured (pid < 2) and predicted, each with its duration
        for pids in ({0, 1}, {2, 3}):
            ws = [x for x in both if x.get("cat") == "W" and x["pid"] in pids]
            assert len(ws) == 2 * v * ZB_M and all(x["dur"] > 0 for x in ws)
