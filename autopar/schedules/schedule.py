"""Pipeline schedules as plain data: generate, lower, validate, dry-run.

Vocabulary (see ARCHITECTURE.md): ``p`` pipeline stages, ``v`` virtual chunks
per stage, so ``p*v`` model chunks ``0 .. p*v-1``; chunk ``c`` lives on stage
``c % p`` (interleaved placement). ``m`` microbatches ``0 .. m-1``.

Dependencies, for chunk ``c`` and microbatch ``i`` (``L = p*v - 1`` is the
last chunk, which holds the loss)::

    F(c, i)  needs  F(c-1, i)                      (c > 0)
    B(c, i)  needs  F(c, i)  and  B(c+1, i)        (B(L, i) needs only F(L, i))

A schedule is, per stage, the list of :class:`Action` s that stage executes in
order. Generators (:func:`gpipe`, :func:`one_f_one_b`,
:func:`interleaved_1f1b`) emit compute actions only; :func:`lower` adds the
point-to-point communication that makes every cross-stage dependency an
explicit, matched send and receive; :func:`validate` checks a schedule
(coverage, order, matching, the in-flight bound, freedom from deadlock) and
:func:`dry_run` times it. Nothing here touches torch.distributed: the runtime
only interprets these lists.

Text forms (compact, parsed back exactly by :meth:`Action.parse`)::

    F2.0      forward of chunk 2, microbatch 0
    B2.0      backward of chunk 2, microbatch 0
    SF2.0>3   send chunk 2's output activation (microbatch 0) to stage 3
    RF3.0<2   receive chunk 3's input activation (microbatch 0) from stage 2
    SB3.0>2   send the gradient of chunk 3's input to stage 2
    RB2.0<3   receive the gradient of chunk 2's output from stage 3

A communication action always names the *local* chunk it belongs to, so
``SF c.i`` on one stage matches ``RF c+1.i`` on the peer, and ``SB c.i``
matches ``RB c-1.i``.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction

from autopar.core.config import SCHEDULE_NAMES, microbatch_errors, size_errors

__all__ = [
    "Kind",
    "Action",
    "Schedule",
    "ScheduleError",
    "DryRun",
    "Time",
    "SCHEDULE_NAMES",
    "num_warmup",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "generate",
    "lower",
    "validate",
    "dry_run",
    "peak_in_flight",
    "parse_grid",
]

Time = int | float | Fraction
"""A duration or a point in time; pass :class:`~fractions.Fraction` costs for exact results."""



class Kind(str, Enum):
    """What an action does; the value is its short text code."""

    F = "F"
    """Forward of one chunk for one microbatch."""
    B = "B"
    """Backward (input and weight gradients) of one chunk for one microbatch."""
    SEND_F = "SF"
    """Send the chunk's output activation to the next chunk's stage."""
    RECV_F = "RF"
    """Receive the chunk's input activation from the previous chunk's stage."""
    SEND_B = "SB"
    """Send the gradient of the chunk's input to the previous chunk's stage."""
    RECV_B = "RB"
    """Receive the gradient of the chunk's output from the next chunk's stage."""


# kind -> (partner kind, chunk offset of the partner); SF c <-> RF c+1, SB c <-> RB c-1.
_PARTNER: dict[Kind, tuple[Kind, int]] = {
    Kind.SEND_F: (Kind.RECV_F, +1),
    Kind.RECV_F: (Kind.SEND_F, -1),
    Kind.SEND_B: (Kind.RECV_B, -1),
    Kind.RECV_B: (Kind.SEND_B, +1),
}

_ACTION_RE = re.compile(r"(SF|RF|SB|RB|F|B)(\d+)\.(\d+)(?:([<>])(\d+))?")

_Key = tuple[Kind, int, int]  # (kind, chunk, microbatch): unique within a valid schedule
_Loc = tuple[int, int]  # (stage, index in that stage's action list)


@dataclass(frozen=True, slots=True, repr=False)
class Action:
    """One step of one stage: ``kind`` of ``chunk`` for ``microbatch``.

    ``peer`` is the other stage of a send or receive and ``None`` for compute.
    """

    kind: Kind
    """F, B, or one of the four point-to-point kinds."""
    chunk: int
    """The local model chunk the action belongs to (0 .. p*v-1)."""
    microbatch: int
    """Microbatch index (0 .. m-1)."""
    peer: int | None = None
    """The stage sent to / received from; None for F and B."""

    def __post_init__(self) -> None:
        if type(self.kind) is not Kind:
            object.__setattr__(self, "kind", Kind(self.kind))
        if self.chunk < 0 or self.microbatch < 0:
            raise ValueError(
                f"negative chunk or microbatch in {self.kind.value}{self.chunk}.{self.microbatch}"
            )
        compute = self.kind is Kind.F or self.kind is Kind.B
        if compute != (self.peer is None):
            what = "must not have" if compute else "needs"
            raise ValueError(
                f"a {self.kind.name} action {what} a peer stage (got peer={self.peer})"
            )

    @property
    def is_compute(self) -> bool:
        """True for F and B."""
        return self.peer is None  # __post_init__ ties the peer to the kind

    @property
    def is_comm(self) -> bool:
        """True for the four send/receive kinds."""
        return self.peer is not None

    @property
    def is_send(self) -> bool:
        return self.kind is Kind.SEND_F or self.kind is Kind.SEND_B

    @property
    def is_recv(self) -> bool:
        return self.kind is Kind.RECV_F or self.kind is Kind.RECV_B

    @property
    def key(self) -> _Key:
        """``(kind, chunk, microbatch)``: identifies the action within a schedule."""
        return (self.kind, self.chunk, self.microbatch)

    def __str__(self) -> str:
        text = f"{self.kind.value}{self.chunk}.{self.microbatch}"
        if self.peer is not None:
            text += (">" if self.is_send else "<") + str(self.peer)
        return text

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("SF2.0>3") == Action(Kind.SEND_F, 2, 0, 3)``."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected e.g. 'F2.0', 'B2.0', 'SF2.0>3', 'RF3.0<2'"
            )
        code, chunk, microbatch, arrow, peer = match.groups()
        action = cls(Kind(code), int(chunk), int(microbatch), None if peer is None else int(peer))
        if arrow is not None and arrow != (">" if action.is_send else "<"):
            raise ValueError(f"cannot parse action {text!r}: sends use '>peer', receives '<peer'")
        return action


class ScheduleError(ValueError):
    """A schedule failed validation; the message shows the grid with the failing actions marked."""

    def __init__(self, message: str, marks: Sequence[_Loc] = ()) -> None:
        super().__init__(message)
        self.marks: tuple[_Loc, ...] = tuple(marks)
        """(stage, index) of each marked action."""


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists of one pipeline step over ``m`` microbatches.

    ``str(schedule)`` is the rank x time grid (:meth:`format_grid`);
    :func:`parse_grid` reads it back.
    """

    name: str
    """One word: 'gpipe', '1f1b', 'interleaved' or any custom name."""
    p: int
    """Pipeline stages."""
    v: int
    """Virtual chunks per stage (p*v chunks in all)."""
    m: int
    """Microbatches per step."""
    actions: dict[int, list[Action]] = field(repr=False)
    """Stage -> the actions it runs, in order."""

    def __post_init__(self) -> None:
        errs = size_errors(p=self.p, v=self.v, m=self.m)
        if errs:
            raise ValueError("; ".join(errs))
        if not self.name or any(ch.isspace() for ch in self.name):
            raise ValueError(f"a schedule name must be one non-empty word, got {self.name!r}")
        if set(self.actions) != set(range(self.p)):
            raise ValueError(
                f"a schedule for p={self.p} needs action lists for stages 0..{self.p - 1}, "
                f"got stages {sorted(self.actions)}"
            )

    @property
    def num_chunks(self) -> int:
        """``p * v``."""
        return self.p * self.v

    def stage_of(self, chunk: int) -> int:
        """Interleaved placement: chunk ``c`` lives on stage ``c % p``."""
        return chunk % self.p

    @property
    def is_lowered(self) -> bool:
        """True when the schedule carries explicit sends and receives."""
        return any(a.is_comm for acts in self.actions.values() for a in acts)

    def in_flight_bound(self, stage: int) -> int:
        """Most (chunk, microbatch) activations ``stage`` may hold (F done, B not yet).

        For the named schedules this is ``min(w_r + 1, v*m)`` with ``w_r`` =
        :func:`num_warmup` (a stage runs its warm-up forwards, then one more
        forward before its first backward); that is ``v*m`` for GPipe,
        ``min(p - r, m)`` for 1F1B and ``min(2(p-r-1) + (v-1)p + 1, v*m)`` for
        interleaved 1F1B. Custom schedules are bounded only by ``v*m``.
        """
        total = self.v * self.m
        if self.name not in SCHEDULE_NAMES:
            return total
        return min(num_warmup(self.name, self.p, self.v, self.m, stage) + 1, total)

    def format_grid(
        self, marks: Iterable[_Loc] = (), columns: tuple[int, int] | None = None
    ) -> str:
        """Rank x time grid: one row per stage, column t = the stage's t-th action.

        Marked actions print as ``[F2.0]``. ``columns=(lo, hi)`` clips the
        grid to steps ``lo .. hi-1`` (shown with ``...``; a clipped grid does
        not parse back).
        """
        marked = set(marks)
        steps = max((len(acts) for acts in self.actions.values()), default=0)
        lo, hi = columns if columns is not None else (0, steps)
        lo, hi = max(0, lo), min(steps, hi)

        def cell(s: int, t: int) -> str:
            acts = self.actions[s]
            if t >= len(acts):
                return ""
            return f"[{acts[t]}]" if (s, t) in marked else str(acts[t])

        cells = {s: [cell(s, t) for t in range(lo, hi)] for s in range(self.p)}
        widths = [
            max([len(str(lo + j))] + [len(cells[s][j]) for s in cells]) for j in range(hi - lo)
        ]
        label_width = len(f"stage {self.p - 1}:")
        head = "... " if lo > 0 else ""
        tail = " ..." if hi < steps else ""

        def row(label: str, items: list[str]) -> str:
            body = " ".join(item.ljust(w) for item, w in zip(items, widths, strict=True))
            return f"{label.ljust(label_width)} {head}{body}{tail}".rstrip()

        lines = [f"{self.name} p={self.p} v={self.v} m={self.m}"]
        lines.append(row("step", [str(t) for t in range(lo, hi)]))
        lines += [row(f"stage {s}:", cells[s]) for s in range(self.p)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_grid()


def parse_grid(text: str) -> Schedule:
    """Inverse of :meth:`Schedule.format_grid` (unclipped); marks ``[..]`` are ignored."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        raise ValueError("cannot parse an empty schedule grid")
    head = re.fullmatch(r"(\S+) p=(\d+) v=(\d+) m=(\d+)", lines[0])
    if head is None:
        raise ValueError(f"grid header {lines[0]!r} should read '<name> p=<p> v=<v> m=<m>'")
    name, p, v, m = head.group(1), *map(int, head.groups()[1:])
    actions: dict[int, list[Action]] = {}
    for line in lines[1:]:
        if line.startswith("step"):
            continue
        row = re.fullmatch(r"stage (\d+):(.*)", line)
        if row is None:
            raise ValueError(f"cannot parse grid line {line!r}: expected 'stage <r>: <actions>'")
        tokens = row.group(2).split()
        if "..." in tokens:
            raise ValueError(
                "cannot parse a clipped grid (it shows '...'); format it without columns="
            )
        actions[int(row.group(1))] = [Action.parse(tok.strip("[]")) for tok in tokens]
    return Schedule(name, p, v, m, actions)


# --------------------------------------------------------------------------- generators


def _check_layout(name: str, p: int, v: int, m: int) -> None:
    errs = microbatch_errors(name, p, v, m)
    if errs:
        raise ValueError("; ".join(errs))


def num_warmup(name: str, p: int, v: int, m: int, stage: int) -> int:
    """Forwards stage ``r`` runs before its steady state (the paper's warm-up).

    - gpipe: ``v m`` (every forward comes first)
    - 1f1b: ``min(p - r - 1, m)``
    - interleaved: ``min(2 (p - r - 1) + (v - 1) p, v m)``

    The steady state then opens with one more forward, so the first backward
    on stage ``r`` follows ``min(w_r + 1, v m)`` forwards.
    """
    if not 0 <= stage < p:
        raise ValueError(f"stage must be in 0..{p - 1}, got {stage}")
    if name == "gpipe":
        return v * m
    if name == "1f1b":
        return min(p - stage - 1, m)
    if name == "interleaved":
        return min(2 * (p - stage - 1) + (v - 1) * p, v * m)
    raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}")


def _interleave(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """Warm-up forwards, then alternate one forward and one backward, then cool-down backwards."""
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for k in range(steady):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[steady:]


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe: every forward, then every backward.

    Stage ``r`` visits its chunks ``r, r+p, ..`` in order for the forwards and
    in reverse for the backwards, all ``m`` microbatches per chunk
    (chunk-major). With ``L = (v-1) max(m, p) + m + p - 1`` steps per phase the
    makespan is ``L (t_f + t_b)`` against ``v m (t_f + t_b)`` of work, so

        bubble = ((p - 1) + (v - 1) max(p - m, 0)) / (v m)

    which is ``(p-1)/m`` for ``v = 1`` and ``(p-1)/(v m)`` for ``m >= p``.
    Every stage holds all ``v m`` activations at the peak.
    """
    _check_layout("gpipe", p, v, m)
    actions = {}
    for r in range(p):
        chunks = [r + k * p for k in range(v)]
        forwards = [Action(Kind.F, c, i) for c in chunks for i in range(m)]
        backwards = [Action(Kind.B, c, i) for c in reversed(chunks) for i in range(m)]
        actions[r] = forwards + backwards
    return _checked(Schedule("gpipe", p, v, m, actions))


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush (1F1B), ``m >= p``.

    Stage ``r`` runs ``w_r = min(p - r - 1, m)`` warm-up forwards, then
    ``m - w_r`` pairs (forward ``w_r + k``, backward ``k``), then ``w_r``
    cool-down backwards. Bubble ``(p-1)/m`` as GPipe, but stage ``r`` holds at
    most ``p - r`` activations instead of ``m``.
    """
    _check_layout("1f1b", p, 1, m)
    actions = {}
    for r in range(p):
        forwards = [Action(Kind.F, r, i) for i in range(m)]
        backwards = [Action(Kind.B, r, i) for i in range(m)]
        actions[r] = _interleave(forwards, backwards, num_warmup("1f1b", p, 1, m, r))
    return _checked(Schedule("1f1b", p, 1, m, actions))


def _megatron_chunk(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """(local chunk, microbatch) of a stage's k-th forward or backward.

    Megatron-LM's ``get_model_chunk_id``: virtual microbatches go in groups of
    ``p`` per chunk, ``k mod (p v) // p`` is the local chunk (reversed for
    backwards) and microbatch ``(k // (p v)) p + k mod p``.
    """
    local = (k % (p * v)) // p
    if not forward:
        local = v - 1 - local
    return local, (k // (p * v)) * p + k % p


def interleaved_1f1b(p: int, v: int, m: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B: ``v`` chunks per stage, ``m % p == 0``.

    Stage ``r`` owns chunks ``r, r+p, .., r+(v-1)p``; its k-th forward/backward
    visits the chunk chosen by :func:`_megatron_chunk`. Warm-up
    ``w_r = min(2 (p-r-1) + (v-1) p, v m)`` forwards, then alternate, then
    cool down. Bubble ``(p-1)/(v m)``: ``v`` times smaller than 1F1B for ``v``
    times the point-to-point messages. (That is the compute-only dry run; a
    runtime that blocks on each batch of exchanges, sends included, loses part
    of it when ``t_b != t_f``; autopar's does not block on sends, see
    ``autopar.planning.simulate.simulate_lowered``.)
    """
    _check_layout("interleaved", p, v, m)
    actions = {}
    for r in range(p):
        steps = [
            (_megatron_chunk(k, p, v, True), _megatron_chunk(k, p, v, False)) for k in range(v * m)
        ]
        forwards = [Action(Kind.F, local * p + r, i) for (local, i), _ in steps]
        backwards = [Action(Kind.B, local * p + r, i) for _, (local, i) in steps]
        actions[r] = _interleave(forwards, backwards, num_warmup("interleaved", p, v, m, r))
    return _checked(Schedule("interleaved", p, v, m, actions))


def generate(name: str, p: int, v: int, m: int) -> Schedule:
    """Dispatch by name: 'gpipe', '1f1b' (needs v = 1) or 'interleaved'."""
    if name == "gpipe":
        return gpipe(p, m, v)
    if name == "1f1b":
        _check_layout(name, p, v, m)
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, v, m)
    raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}")


def _checked(schedule: Schedule) -> Schedule:
    validate(schedule)
    return schedule


# --------------------------------------------------------------------------- lowering


def lower(
    schedule: Schedule,
    cost_f: Time | Callable[[Action], Time] = 1,
    cost_b: Time | Callable[[Action], Time] = 1,
) -> Schedule:
    """Add the sends and receives that carry every cross-stage dependency.

    Sends: right after the compute that produced the tensor (``SF c.i >
    s(c+1)`` after ``F(c, i)``, ``SB c.i > s(c-1)`` after ``B(c, i)``).
    A neighbour on the same stage (only when ``p == 1``) needs no message.

    Receives: the runtime posts a run of consecutive sends/receives as one
    batched exchange and waits for all of it, so a send blocks until its
    receive is posted. A receive therefore goes into the gap (between two
    compute actions) its stage is in when the producer finishes, in a dry run
    of the compute-only schedule with the given costs: the first gap ``j``
    with ``start(j) >= T``, ``T`` the producer's end. That is never after the
    gap just before the consumer (where it lands in most cases); when it is
    earlier, the tensor waits in a buffer, as in Megatron-LM's lock-step
    exchanges (interleaved 1F1B, GPipe with ``m > p`` chunks).

    With ``t_f = t_b`` (the default costs) every producer of the three
    generators finishes on a gap of its receiver, and the lowered schedule
    times exactly like the compute-only one. Where the receiver is busy at
    ``T`` the sender waits: with ``t_b = 2 t_f`` GPipe and 1F1B still keep
    their timing, but interleaved 1F1B loses bubble (p=2, v=2, m=4: 7/24
    instead of 1/8), the price of waiting on each exchange at once.

    The result is validated.
    """
    if schedule.is_lowered:
        raise ValueError(
            f"schedule {schedule.name!r} is already lowered (it has sends and receives)"
        )
    run = dry_run(schedule, cost_f, cost_b)
    where = _index(schedule)
    slots = {s: [[] for _ in range(len(acts) + 1)] for s, acts in schedule.actions.items()}
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            slots[s][t + 1] += _sends(schedule, s, a)
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            for recv, (ps, pt) in _receives(schedule, s, a, where):
                ready = run.end[ps][pt]
                slots[s][bisect_left(run.start[s], ready, hi=t)].append(recv)
    actions = {s: _interleave_slots(slots[s], acts) for s, acts in schedule.actions.items()}
    return _checked(Schedule(schedule.name, schedule.p, schedule.v, schedule.m, actions))


def _sends(schedule: Schedule, stage: int, action: Action) -> list[Action]:
    """The send shipping ``action``'s result to a neighbour on another stage, if any."""
    target = action.chunk + 1 if action.kind is Kind.F else action.chunk - 1
    if not 0 <= target < schedule.num_chunks or schedule.stage_of(target) == stage:
        return []
    kind = Kind.SEND_F if action.kind is Kind.F else Kind.SEND_B
    return [Action(kind, action.chunk, action.microbatch, schedule.stage_of(target))]


def _receives(
    schedule: Schedule, stage: int, action: Action, where: dict[_Key, _Loc]
) -> list[tuple[Action, _Loc]]:
    """The receive ``action`` needs from another stage, if any, with its producer's location."""
    kind = Kind.RECV_F if action.kind is Kind.F else Kind.RECV_B
    return [
        (Action(kind, action.chunk, action.microbatch, schedule.stage_of(key[1])), where[key])
        for key in _producers(schedule, action)
        if schedule.stage_of(key[1]) != stage
    ]


def _interleave_slots(slots: list[list[Action]], compute: list[Action]) -> list[Action]:
    """``slots[0], compute[0], slots[1], compute[1], .., slots[n]`` flattened."""
    out = list(slots[0])
    for a, gap in zip(compute, slots[1:], strict=True):
        out += [a, *gap]
    return out


# --------------------------------------------------------------------------- validation


def _fail(schedule: Schedule, message: str, marks: Sequence[_Loc]) -> ScheduleError:
    """A ScheduleError whose message ends with the grid around the marked actions."""
    if marks:
        steps = [t for _, t in marks]
        columns = (min(steps) - 8, max(steps) + 9)
        where = ", ".join(f"stage {s} step {t}" for s, t in marks)
        grid = schedule.format_grid(marks, columns)
        message = f"{message}\n(marked: {where})\n{grid}"
    else:
        message = f"{message}\n{schedule.format_grid()}"
    return ScheduleError(message, marks)


def _producers(schedule: Schedule, action: Action) -> list[_Key]:
    """Compute actions whose results ``action`` (F or B) consumes."""
    c, i = action.chunk, action.microbatch
    if action.kind is Kind.F:
        return [(Kind.F, c - 1, i)] if c > 0 else []
    deps: list[_Key] = [(Kind.F, c, i)]
    if c < schedule.num_chunks - 1:
        deps.append((Kind.B, c + 1, i))
    return deps


def _partner(schedule: Schedule, action: Action) -> tuple[_Key, int]:
    """The matching action of a send/receive and the stage it must be on."""
    kind, offset = _PARTNER[action.kind]
    chunk = action.chunk + offset
    return (kind, chunk, action.microbatch), schedule.stage_of(chunk)


def _index(schedule: Schedule) -> dict[_Key, _Loc]:
    """Where each action sits; raises on duplicates."""
    where: dict[_Key, _Loc] = {}
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            if a.key in where:
                first = where[a.key]
                raise _fail(
                    schedule,
                    f"{a.kind.value}{a.chunk}.{a.microbatch} appears twice",
                    [first, (s, t)],
                )
            where[a.key] = (s, t)
    return where


def _check_placement(schedule: Schedule) -> None:
    """Chunk and microbatch in range, on the chunk's stage; comm peers point at the neighbour."""
    last = schedule.num_chunks - 1
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            if a.chunk > last or a.microbatch >= schedule.m:
                raise _fail(
                    schedule,
                    f"{a} is out of range: chunks are 0..{last}, microbatches 0..{schedule.m - 1}",
                    [(s, t)],
                )
            if schedule.stage_of(a.chunk) != s:
                home = schedule.stage_of(a.chunk)
                raise _fail(
                    schedule,
                    f"{a} is on stage {s}, but chunk {a.chunk} lives on stage {home}",
                    [(s, t)],
                )
            if a.is_comm:
                _check_peer(schedule, a, (s, t))


def _check_peer(schedule: Schedule, action: Action, loc: _Loc) -> None:
    (_, chunk, _), stage = _partner(schedule, action)
    if not 0 <= chunk < schedule.num_chunks:
        raise _fail(schedule, f"{action} has no neighbour chunk {chunk} to talk to", [loc])
    if stage == loc[0]:
        raise _fail(
            schedule, f"{action} is not needed: chunk {chunk} lives on the same stage", [loc]
        )
    if action.peer != stage:
        raise _fail(
            schedule,
            f"{action} names peer {action.peer}, but chunk {chunk} lives on stage {stage}",
            [loc],
        )


def _check_coverage(schedule: Schedule, where: dict[_Key, _Loc]) -> None:
    """Every (chunk, microbatch) has one F and one B."""
    for kind in (Kind.F, Kind.B):
        for c in range(schedule.num_chunks):
            for i in range(schedule.m):
                if (kind, c, i) not in where:
                    raise _fail(
                        schedule,
                        f"missing {kind.value}{c}.{i} (on stage {schedule.stage_of(c)})",
                        [],
                    )


def _check_matching(schedule: Schedule, where: dict[_Key, _Loc]) -> None:
    """Every send has exactly one receive and vice versa (duplicates are caught by ``_index``)."""
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            if not a.is_comm:
                continue
            key, stage = _partner(schedule, a)
            if key not in where:
                other = "receive" if a.is_send else "send"
                expected = Action(key[0], key[1], key[2], s)
                message = f"{a} on stage {s} has no matching {other} {expected} on stage {stage}"
                raise _fail(schedule, message, [(s, t)])


def _check_order(schedule: Schedule, where: dict[_Key, _Loc]) -> None:
    """Each action comes after what it needs on its own stage.

    F before its B; a local producer before its consumer; in a lowered schedule
    also every remote producer's receive before the consumer and every send
    after the compute it ships.
    """
    lowered = schedule.is_lowered
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            for need in _local_needs(schedule, a, s, lowered):
                loc = where.get(need)
                needed = f"{need[0].value}{need[1]}.{need[2]}"
                if loc is None:
                    raise _fail(
                        schedule,
                        f"{a} on stage {s} needs {needed} before it, and there is none",
                        [(s, t)],
                    )
                if loc[1] > t:
                    raise _fail(
                        schedule,
                        f"{a} on stage {s} runs before {needed}, which it needs",
                        [(s, t), loc],
                    )


def _local_needs(schedule: Schedule, action: Action, stage: int, lowered: bool) -> list[_Key]:
    """Keys of the actions on ``stage`` that must precede ``action``."""
    if action.is_send:
        compute = Kind.F if action.kind is Kind.SEND_F else Kind.B
        return [(compute, action.chunk, action.microbatch)]
    if action.is_recv:
        return []
    needs: list[_Key] = []
    for key in _producers(schedule, action):
        if schedule.stage_of(key[1]) == stage:
            needs.append(key)
        elif lowered:
            recv = Kind.RECV_F if action.kind is Kind.F else Kind.RECV_B
            needs.append((recv, action.chunk, action.microbatch))
    return needs


def peak_in_flight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most (chunk, microbatch) activations held at once (F run, B not yet)."""
    return {s: max(_in_flight_counts(acts), default=0) for s, acts in schedule.actions.items()}


def _in_flight_counts(actions: list[Action]) -> list[int]:
    """Number of activations held after each action."""
    held, counts = 0, []
    for a in actions:
        if a.kind is Kind.F:
            held += 1
        elif a.kind is Kind.B:
            held -= 1
        counts.append(held)
    return counts


def _check_in_flight(schedule: Schedule) -> None:
    for s, acts in schedule.actions.items():
        bound = schedule.in_flight_bound(s)
        for t, held in enumerate(_in_flight_counts(acts)):
            if held > bound:
                raise _fail(
                    schedule,
                    f"stage {s} holds {held} activations after {acts[t]}, "
                    f"above the {schedule.name} bound of {bound}",
                    [(s, t)],
                )


def validate(schedule: Schedule) -> None:
    """Check a schedule; raise :class:`ScheduleError` (a ValueError) with the grid marked.

    Asserts, in order: every action is on its chunk's stage with in-range
    indices and (for sends/receives) the right peer; each (chunk, microbatch)
    has exactly one F and one B; each send has exactly one matching receive;
    on every stage an action follows what it needs locally (F before its B,
    local producers, and in a lowered schedule the receive of each remote
    input and the compute before each send); per stage r the in-flight count
    never exceeds :meth:`Schedule.in_flight_bound`; and a dry run with the
    batched-exchange semantics of :func:`dry_run` finishes (no deadlock).
    """
    _check_placement(schedule)
    where = _index(schedule)
    _check_coverage(schedule, where)
    _check_matching(schedule, where)
    _check_order(schedule, where)
    _check_in_flight(schedule)
    _Simulator(schedule, lambda _a: 1, where).run()


# --------------------------------------------------------------------------- dry run


@dataclass(frozen=True)
class DryRun:
    """Timing of one step: per stage, start and end of every action (same order as the schedule)."""

    start: dict[int, list[Time]]
    """Stage -> start time of each action."""
    end: dict[int, list[Time]]
    """Stage -> end time of each action."""
    busy: dict[int, Time]
    """Stage -> total compute time."""
    makespan: Time
    """Time at which the last action ends."""

    @property
    def bubble(self) -> dict[int, Time]:
        """Per stage, bubble time over ideal compute time: ``(makespan - busy) / busy``."""
        return {s: _ratio(self.makespan - b, b) for s, b in self.busy.items()}

    @property
    def bubble_fraction(self) -> Time:
        """The largest per-stage bubble (all stages agree under uniform costs)."""
        return max(self.bubble.values())


def _ratio(num: Time, den: Time) -> Time:
    """``num / den``, exact (a Fraction) when both are ints or Fractions."""
    if isinstance(num, int | Fraction) and isinstance(den, int | Fraction):
        return Fraction(num) / den
    return num / den


def _units(actions: list[Action]) -> list[tuple[int, int]]:
    """Split a stage's list into units: one compute action, or a maximal run of sends/receives."""
    units, t = [], 0
    while t < len(actions):
        end = t + 1
        if actions[t].is_comm:
            while end < len(actions) and actions[end].is_comm:
                end += 1
        units.append((t, end))
        t = end
    return units


class _Simulator:
    """Runs every stage's list in order, each action as early as its dependencies allow.

    The list of a stage is cut into units: one compute action, or a maximal
    run of sends/receives. A compute unit starts at ``max(stage free, end of
    each producer)`` and lasts ``cost(action)``. A communication unit is
    posted as one batch (``batch_isend_irecv``) when its stage reaches it, and
    the stage then waits for all of it: a send/receive pair completes the
    moment both sides are posted, so the unit ends at ``max(own post,
    partners' posts)``; transfers are instant. A send therefore blocks until
    its receive is posted, as with NCCL. If some stage cannot finish, that is
    a deadlock.

    Stages run until blocked on another stage, and are woken when it moves
    (a work list), so a run costs time linear in the schedule's length.
    """

    def __init__(
        self, schedule: Schedule, cost: Callable[[Action], Time], where: dict[_Key, _Loc]
    ) -> None:
        self.schedule, self.cost = schedule, cost
        self.units = {s: _units(acts) for s, acts in schedule.actions.items()}
        unit_of = {
            (s, t): u
            for s, us in self.units.items()
            for u, (a, b) in enumerate(us)
            for t in range(a, b)
        }
        # needs[s][u]: (stage, pc, where) triples; unit u of stage s may run once pc[stage] >= pc.
        # A producer must be done (pc past its unit), a partner only posted (pc at its unit).
        self.needs = {
            s: [self._needs(s, a, b, where, unit_of) for a, b in us] for s, us in self.units.items()
        }
        self.pc = dict.fromkeys(schedule.actions, 0)
        self.free: dict[int, Time] = dict.fromkeys(schedule.actions, 0)
        self.unit_start: dict[int, list[Time]] = {s: [0] * len(us) for s, us in self.units.items()}
        self.unit_end: dict[int, list[Time]] = {s: [0] * len(us) for s, us in self.units.items()}

    def _needs(
        self, s: int, a: int, b: int, where: dict[_Key, _Loc], unit_of: dict[_Loc, int]
    ) -> list[tuple[int, int, _Loc]]:
        acts = self.schedule.actions[s]
        if acts[a].is_compute:
            locs = [where[k] for k in _producers(self.schedule, acts[a])]
            return [(loc[0], unit_of[loc] + 1, loc) for loc in locs]
        locs = [where[_partner(self.schedule, x)[0]] for x in acts[a:b]]
        return [(loc[0], unit_of[loc], loc) for loc in locs]

    def blockers(self, s: int) -> list[_Loc]:
        """Where the actions are that keep stage ``s`` from running its current unit."""
        return [loc for ns, npc, loc in self.needs[s][self.pc[s]] if self.pc[ns] < npc]

    def step(self, s: int) -> None:
        """Run stage ``s``'s current unit; its needs are met."""
        u = self.pc[s]
        a, _ = self.units[s][u]
        action = self.schedule.actions[s][a]
        t0 = self.free[s]
        if action.is_compute:
            t0 = max([t0] + [self.unit_end[ns][npc - 1] for ns, npc, _ in self.needs[s][u]])
            t1 = t0 + self.cost(action)
        else:
            t1 = max([t0] + [self.unit_start[ns][npc] for ns, npc, _ in self.needs[s][u]])
        self.unit_start[s][u], self.unit_end[s][u] = t0, t1
        self.free[s], self.pc[s] = t1, u + 1
        if u + 1 < len(self.units[s]):
            self.unit_start[s][u + 1] = t1  # posted now, if it is an exchange

    def run(self) -> tuple[dict[int, list[Time]], dict[int, list[Time]]]:
        """Start and end of every action, per stage; raise ScheduleError on a deadlock."""
        waiting: dict[int, list[int]] = {s: [] for s in self.schedule.actions}
        ready = list(self.schedule.actions)
        while ready:
            s = ready.pop()
            while self.pc[s] < len(self.units[s]):
                if blocked := self.blockers(s):
                    waiting[blocked[0][0]].append(s)
                    break
                self.step(s)
                ready += waiting[s]
                waiting[s] = []
        stuck = [s for s in self.schedule.actions if self.pc[s] < len(self.units[s])]
        if stuck:
            raise self.deadlock(stuck)
        return self._per_action(self.unit_start), self._per_action(self.unit_end)

    def _per_action(self, per_unit: dict[int, list[Time]]) -> dict[int, list[Time]]:
        return {
            s: [per_unit[s][u] for u, (a, b) in enumerate(us) for _ in range(a, b)]
            for s, us in self.units.items()
        }

    def deadlock(self, stuck: list[int]) -> ScheduleError:
        """Explain what each blocked stage waits for."""
        lines, marks = [], []
        for s in stuck:
            a, b = self.units[s][self.pc[s]]
            marks += [(s, t) for t in range(a, b)]
            acts = self.schedule.actions[s]
            waits = ", ".join(
                f"{self.schedule.actions[ws][wt]} (stage {ws} step {wt})"
                for ws, wt in self.blockers(s)
            )
            if acts[a].is_compute:
                lines.append(f"  stage {s} waits at {acts[a]} for {waits} to finish")
            else:
                lines.append(
                    f"  stage {s} waits in exchange [{' '.join(map(str, acts[a:b]))}] "
                    f"for {waits} to be posted"
                )
        return _fail(
            self.schedule, "deadlock: no stage can make progress\n" + "\n".join(lines), marks
        )


def _as_cost(cost: Time | Callable[[Action], Time]) -> Callable[[Action], Time]:
    return cost if callable(cost) else (lambda _a: cost)


def dry_run(
    schedule: Schedule,
    cost_f: Time | Callable[[Action], Time] = 1.0,
    cost_b: Time | Callable[[Action], Time] = 2.0,
) -> DryRun:
    """Event simulation of one step with per-action durations and instant communication.

    ``cost_f`` / ``cost_b``: a duration for every F / B, or a function of the
    action (e.g. per-chunk costs). Sends and receives take no time, but a
    batched exchange waits for its peers (see ``_Simulator``); a compute-only
    schedule waits directly for its producers. For compute-only schedules
    with uniform costs ``t_f, t_b``: 1F1B takes ``(m + p - 1)(t_f + t_b)``,
    so its bubble is ``(p-1)/m``, as GPipe's with ``v = 1``; interleaved
    1F1B's is ``(p-1)/(v m)``. Integer or :class:`~fractions.Fraction`
    costs give exact :class:`~fractions.Fraction` bubbles.

    The bubble of a stage is its idle time over its compute time,
    ``(makespan - busy) / busy`` (the paper's bubble time over ideal time).
    Raises :class:`ScheduleError` if the schedule misplaces or misses actions,
    has an unmatched send or receive, or deadlocks (an action placed before
    what it needs on its own stage shows as a deadlock); :func:`validate`
    checks the rest.
    """
    _check_placement(schedule)
    where = _index(schedule)
    _check_coverage(schedule, where)
    _check_matching(schedule, where)
    f, b = _as_cost(cost_f), _as_cost(cost_b)

    def cost(action: Action) -> Time:
        return f(action) if action.kind is Kind.F else b(action)

    start, end = _Simulator(schedule, cost, where).run()
    busy = {
        s: sum((end[s][t] - start[s][t] for t, a in enumerate(acts) if a.is_compute), start=0)
        for s, acts in schedule.actions.items()
    }
    makespan = max((e for ends in end.values() for e in ends), default=0)
    return DryRun(start, end, busy, makespan)
