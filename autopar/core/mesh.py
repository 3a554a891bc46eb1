"""The mesh: rank <-> (pp, dp, cp, tp) coordinates and the process groups (expert groups inside a stage).

Megatron's order: tp varies fastest, then cp (context parallelism), then dp,
then pp,

    rank = tp_rank + t * (cp_rank + c * (dp_rank + d * pp_rank))

so a tensor-parallel group is t consecutive ranks (inside one node), a
context-parallel group strides by t, and a pipeline group by t*c*d. With t=2,
p=4 on 16 GPUs (c=1, d=2): TP groups [0,1],[2,3],...; PP groups
[0,4,8,12],[1,5,9,13],... With t=2, c=2, d=2, p=1: TP [0,1],[2,3],[4,5],[6,7];
CP [0,2],[1,3],[4,6],[5,7]; DP [0,4],[1,5],[2,6],[3,7].

Context parallelism splits each sequence's tokens over the c ranks of a cp
group; they hold the same weights and see the same rows of the batch, so for
the gradients they are replicas like the data-parallel ones: gradients are
averaged over the d*c ranks with the same (pp, tp) coordinates, the 'dp_cp'
group (the dp group itself when c = 1). Every group keeps "the same other
coordinates": 'tp', 'cp', 'dp' and 'pp' vary their own axis only.

Expert parallelism (e) cuts a stage's ranks into expert groups whose ranks
hold different experts and exchange tokens; the ranks at the same place in
their groups hold the same experts and average those experts' gradients (the
expert replicas, 'edp'). Where the experts are split over tensor parallelism
as the dense layers are (expert tp = t, the default), the groups lie inside
data parallelism, at one tp rank: e consecutive replicas, e dividing d. With
t=1, d=4, e=2: expert groups [0,1],[2,3]; expert replicas [0,2],[1,3]. Where
each expert stays whole (expert tp = 1), the groups run over the stage's t*d
ranks in rank order (tp fastest), e dividing t*d, and the tp ranks of a
replica split its token rows among them before the exchange: with t=2, d=2,
e=2 the expert groups are the tp groups [0,1],[2,3] and the replicas [0,2],[1,3].

``MeshShape`` is pure arithmetic (no process group); ``Mesh.create`` makes
every group once (all ranks must call it, in the same order) and keeps this
rank's. The mesh is passed to whoever needs it.

Groups over the same ranks are shared by every mesh of the process (until the
default group is destroyed): a second engine, at the same or another layout,
reuses the groups the first one made instead of creating more. Each gloo group
holds its own connections and a network thread that wakes every 10 ms, so a
process that builds engine after engine (evaluation, resharding, a sweep of
layouts) would otherwise pile up idle threads that compete with the ranks for
the CPU; a new group also costs a store rendezvous of every rank. Sharing is
safe because a rank runs one engine's collectives at a time, in the order every
rank runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from autopar.core.errors import AutoparError, ConfigError

__all__ = ["MeshShape", "Mesh", "MeshError", "group_over", "forget_groups"]

_SHARED: dict[tuple, Any] = {}
"""(purpose, backend, sorted member ranks) -> the process group over them
(``GroupMember.NON_GROUP_MEMBER`` on a rank outside it), for the default group ``_SHARED_WORLD``."""
_SHARED_WORLD: list = [None]


class MeshError(AutoparError, RuntimeError):
    """The mesh cannot make its process groups: torch.distributed is not started for it."""


@dataclass(frozen=True)
class MeshShape:
    tp: int = 1
    """Tensor-parallel degree t."""
    pp: int = 1
    """Pipeline stages p."""
    dp: int = 1
    """Data-parallel replicas d."""
    ep: int = 1
    """Expert-parallel degree e: groups of e ranks of a stage hold different experts; the ranks with the
    same place in their groups hold the same experts."""
    expert_tp: int | None = None
    """How many ways each expert is split by tensor parallelism: t (None, the default: expert groups of e
    data-parallel replicas at one tp rank, e divides d) or 1 (whole experts: expert groups of e
    consecutive ranks of the stage's t*d, e divides t*d)."""
    cp: int = 1
    """Context-parallel degree c: each sequence's tokens split over c ranks holding the same weights
    and the same rows of the batch (last field: positional construction stays (tp, pp, dp, ep, expert_tp))."""

    def __post_init__(self):
        for axis in ("tp", "pp", "dp", "ep", "cp"):
            if getattr(self, axis) < 1:
                raise ConfigError(f"{axis} must be >= 1, got {axis}={getattr(self, axis)}")
        if self.ep > 1 and self.cp > 1:
            raise ConfigError(f"ep={self.ep} with cp={self.cp}: expert parallelism and context parallelism do not "
                              f"combine yet (the expert groups are cut from data-parallel ranks, which cp would "
                              f"interleave). Fix: ep=1 or cp=1")
        if self.expert_tp is not None and self.expert_tp not in (1, self.tp):
            raise ConfigError(f"expert_tp={self.expert_tp}: each expert is split tp={self.tp} ways or kept whole. "
                              f"Fix: expert_tp in {sorted({1, self.tp})}")
        if self.expert_grid % self.ep:
            over = "dp" if self.etp == self.tp else "tp x dp"
            raise ConfigError(f"ep={self.ep} must divide {over}={self.expert_grid}: expert parallelism groups ep "
                              f"ranks of {over}. Fix: ep a divisor of {self.expert_grid}")

    @property
    def etp(self) -> int:
        """Ways each expert is split by tensor parallelism: t, or 1 (whole experts)."""
        return self.tp if self.expert_tp is None else self.expert_tp

    @property
    def expert_grid(self) -> int:
        """Ranks of a stage the expert groups are cut from: d (experts split by tp), or t*d (whole)."""
        return self.dp if self.etp == self.tp else self.tp * self.dp

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (an expert's gradient is averaged over them)."""
        return self.expert_grid // self.ep

    @property
    def rows_split(self) -> int:
        """Ways a replica's token rows are split before the expert exchange: t with whole experts
        under tensor parallelism (each tp rank sends its share), else 1."""
        return self.tp if self.etp != self.tp else 1

    @property
    def replicas_with_every_expert(self) -> int:
        """The fewest leading data-parallel replicas whose ranks make whole expert groups and whole tp
        groups: together they hold every expert (an export gathers the experts over them)."""
        if self.ep == 1:
            return 1
        if self.etp == self.tp:
            return self.ep
        return math.lcm(self.ep, self.tp) // self.tp

    def _expert_grids(self) -> list[list[int]]:
        """Each list of ranks the expert groups are cut from, in expert order."""
        if self.etp == self.tp:
            return [[self.rank(s, d, j) for d in range(self.dp)] for s in range(self.pp) for j in range(self.tp)]
        return [[self.rank(s, d, j) for d in range(self.dp) for j in range(self.tp)] for s in range(self.pp)]

    def expert_index(self, rank: int) -> int:
        """A rank's place in its stage's expert grid (its ep rank is this modulo e)."""
        _, d, j = self.coords(rank)
        return d if self.etp == self.tp else d * self.tp + j

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks over which a gradient is averaged: the d data-parallel replicas times the c
        context-parallel ranks of each (d when c = 1)."""
        return self.dp * self.cp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a rank (its cp coordinate: ``cp_of``)."""
        t, c, d = self.tp, self.cp, self.dp
        return rank // (t * c * d), (rank // (t * c)) % d, rank % t

    def cp_of(self, rank: int) -> int:
        """The context-parallel coordinate of a rank: which of its sequence's token blocks it holds."""
        return (rank // self.tp) % self.cp

    def dp_cp_of(self, rank: int) -> int:
        """A rank's place in its 'dp_cp' group: ``dp * c + cp`` (the group's ranks in rank order)."""
        return self.coords(rank)[1] * self.cp + self.cp_of(rank)

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(s, d, j, c) for j in range(self.tp)]
                for s in range(self.pp) for d in range(self.dp) for c in range(self.cp)]

    def cp_groups(self) -> list[list[int]]:
        """The ranks holding one sequence's token blocks: same pp, dp and tp, cp rank 0..c-1."""
        return [[self.rank(s, d, j, c) for c in range(self.cp)]
                for s in range(self.pp) for d in range(self.dp) for j in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(s, d, j, c) for d in range(self.dp)]
                for s in range(self.pp) for c in range(self.cp) for j in range(self.tp)]

    def dp_cp_groups(self) -> list[list[int]]:
        """The ranks averaging each other's gradients: same pp and tp, every (dp, cp), in rank order
        (dp major). The dp groups when c = 1."""
        return [[self.rank(s, d, j, c) for d in range(self.dp) for c in range(self.cp)]
                for s in range(self.pp) for j in range(self.tp)]

    def ep_groups(self) -> list[list[int]]:
        """Expert-parallel groups: e consecutive ranks of each expert grid; the tokens of a
        mixture-of-experts layer travel inside one to the rank holding their expert."""
        e = self.ep
        return [grid[b * e:(b + 1) * e] for grid in self._expert_grids() for b in range(len(grid) // e)]

    def expert_dp_groups(self) -> list[list[int]]:
        """The ranks holding the same experts (the same place in their expert groups): expert
        gradients are averaged over these, ``edp`` ranks."""
        e = self.ep
        return [grid[i::e] for grid in self._expert_grids() for i in range(e)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(s, d, j, c) for s in range(self.pp)]
                for d in range(self.dp) for c in range(self.cp) for j in range(self.tp)]

    def stage_groups(self, stages: tuple[int, ...]) -> list[list[int]]:
        """For each (dp, cp, tp) position, the ranks of the given pipeline stages (tied parameters)."""
        return [[self.rank(s, d, j, c) for s in stages]
                for d in range(self.dp) for c in range(self.cp) for j in range(self.tp)]


@dataclass
class Mesh:
    """This rank's place in the mesh and its process groups."""

    shape: MeshShape
    rank: int
    groups: dict[str, Any] = field(default_factory=dict)
    """'tp', 'cp', 'dp', 'pp', 'dp_cp' (the dp x cp ranks averaging gradients: the dp group when c = 1),
    and with expert parallelism 'ep' (the replicas holding different experts) and 'edp' (those holding
    the same ones) -> this rank's process group (None when the axis has size 1)."""
    tied: dict[tuple[int, ...], Any] = field(default_factory=dict)
    """Stages sharing a parameter -> this rank's group over them (None if not a member)."""

    @property
    def pp_rank(self) -> int:
        return self.shape.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.shape.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.shape.coords(self.rank)[2]

    @property
    def cp_rank(self) -> int:
        """Which of its sequences' token blocks this rank holds (``cp_layout``), 0 .. c-1."""
        return self.shape.cp_of(self.rank)

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in its 'dp_cp' group: ``dp_rank * c + cp_rank``."""
        return self.shape.dp_cp_of(self.rank)

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group: it holds experts [ep_rank * E/e, (ep_rank + 1) * E/e)."""
        return self.shape.expert_index(self.rank) % self.shape.ep

    @property
    def edp_rank(self) -> int:
        """This rank's place among the ranks holding its experts (the expert replicas)."""
        return self.shape.expert_index(self.rank) // self.shape.ep

    def ep_members(self) -> list[int]:
        """Global ranks of this rank's expert-parallel group, in ep order."""
        return next(g for g in self.shape.ep_groups() if self.rank in g)

    def tp_members(self) -> list[int]:
        """Global ranks of this rank's tensor-parallel group, in tp order."""
        return [self.shape.rank(self.pp_rank, self.dp_rank, j, self.cp_rank) for j in range(self.shape.tp)]

    def cp_members(self) -> list[int]:
        """Global ranks of this rank's context-parallel group, in cp order (the ring's order)."""
        return [self.shape.rank(self.pp_rank, self.dp_rank, self.tp_rank, c) for c in range(self.shape.cp)]

    def peer(self, stage: int) -> int:
        """The global rank at pipeline stage ``stage`` with this rank's dp, cp and tp coordinates."""
        return self.shape.rank(stage, self.dp_rank, self.tp_rank, self.cp_rank)

    @staticmethod
    def create(shape: MeshShape, tied_stage_sets: list[tuple[int, ...]] = ()) -> "Mesh":
        """Create all groups (collective: every rank calls this with the same arguments)."""
        if not dist.is_initialized():
            if shape.world != 1:
                raise MeshError(f"a mesh of {shape.world} ranks needs an initialised process group")
            return Mesh(shape, 0, {"tp": None, "cp": None, "dp": None, "dp_cp": None, "pp": None, "ep": None,
                                   "edp": None})
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != shape.world:
            raise ConfigError(f"tp({shape.tp}) * cp({shape.cp}) * pp({shape.pp}) * dp({shape.dp}) = {shape.world}, "
                             f"but the world size is {world}")
        mesh = Mesh(shape, rank)
        axes = [("tp", shape.tp_groups()), ("dp", shape.dp_groups()), ("pp", shape.pp_groups())]
        if shape.cp > 1:  # with c = 1 'cp' is None and 'dp_cp' is the dp group: no new groups
            axes += [("cp", shape.cp_groups()), ("dp_cp", shape.dp_cp_groups())]
        if shape.ep > 1:  # expert groups only where there are experts to split: no new groups otherwise
            axes += [("ep", shape.ep_groups()), ("edp", shape.expert_dp_groups())]
        for axis, groups in axes:
            mesh.groups[axis] = None
            for ranks in groups:
                g = group_over(ranks)
                if rank in ranks:
                    mesh.groups[axis] = g
        if shape.cp == 1:
            mesh.groups["cp"], mesh.groups["dp_cp"] = None, mesh.groups["dp"]
        for stages in tied_stage_sets:
            mesh.tied[stages] = None
            for ranks in shape.stage_groups(stages):
                g = group_over(ranks)
                if rank in ranks:
                    mesh.tied[stages] = g
        return mesh


def group_over(ranks, *, backend: str | None = None, purpose: str = ""):
    """The process group over ``ranks`` (None for one rank), made by the first call for that set of
    ranks, backend and purpose since the default group started and shared by every later one
    (collective the first time: every rank calls it with the same arguments, in the same order).
    A ``purpose`` keeps a group apart from the meshes' (checkpoints talk over their own)."""
    ranks = sorted(ranks)
    if len(ranks) < 2:
        return None
    if _SHARED_WORLD[0] is not dist.group.WORLD:  # a new default group: the old groups died with the old one
        _SHARED.clear()
        _SHARED_WORLD[0] = dist.group.WORLD
    key = (purpose, backend, tuple(ranks))
    if key not in _SHARED:
        _SHARED[key] = dist.new_group(ranks, backend=backend)
    return _SHARED[key]


def forget_groups() -> None:
    """Make the next ``group_over`` of every set of ranks a new group: the shared ones were stopped
    (a failed step stops every rank's communication, so every rank forgets them alike)."""
    _SHARED.clear()
