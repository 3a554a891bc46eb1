"""What ``autopar tune`` measures, decided before anything runs: the GEMM shapes a model will run
and the groups of ranks its collectives are timed over.

``model_gemm_shapes`` takes the shapes from the very Ops the cost model prices (``transformer.layer_ops``
and ``head_ops``, forward and backward, at each tensor-parallel degree), so the planner finds each of its
GEMMs at the tuned micro-batch measured as it is (``op_times.measured_gemm_rate``). ``tune_groups`` lays
out, for a world of ``world`` ranks ``per_node`` to a node, one group of each size that divides the world
inside a node and across nodes, and the point-to-point pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.transformer import head_ops, layer_ops

__all__ = ["TuneGroup", "model_gemm_shapes", "tune_groups", "divisors"]


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def model_gemm_shapes(spec: ModelSpec, micro_batch: int, tps: tuple[int, ...] = (1,)) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(name, (batch, M, N, K)) of every distinct GEMM one layer (dense, and mixture-of-experts for such a
    model) and the LM head run, forward and backward, at micro-batch ``micro_batch`` and each
    tensor-parallel degree of ``tps`` that divides the heads; named ``fc1 t=2`` and so on."""
    seen: dict[tuple[int, int, int, int], str] = {}
    for t in tps:
        if spec.heads % t:
            continue
        phases = [layer_ops(spec, micro_batch, t), head_ops(spec, micro_batch, t)]
        if spec.is_moe:
            phases.append(layer_ops(spec, micro_batch, t, moe=True))
        for ph in phases:
            for op in ph.forward + ph.backward:
                if op.kind == "gemm" and op.gemm not in seen:
                    seen[op.gemm] = f"{op.name} t={t}"
    return [(name, shape) for shape, name in seen.items()]


@dataclass(frozen=True)
class TuneGroup:
    """One group of ranks a collective (or a point-to-point pair) is timed over."""

    ranks: tuple[int, ...]
    """Global ranks, in order (a pair: sender, receiver)."""
    placement: str
    """``intra`` (one node) or ``inter`` (across nodes)."""
    p2p: bool = False

    @property
    def size(self) -> int:
        return len(self.ranks)


def tune_groups(world: int, per_node: int) -> list[TuneGroup]:
    """The groups to time in a world of ``world`` ranks, ``per_node`` to a node (consecutive ranks share
    a node): for each size n > 1 dividing the world, the first n ranks of node 0 when n divides
    ``per_node`` (intra), and when the world spans nodes a group of n spread over min(n, nodes) nodes,
    n / nodes consecutive ranks on each (inter); a point-to-point pair inside node 0 and one from node 0
    to node 1."""
    nodes = world // per_node
    out: list[TuneGroup] = []
    for n in divisors(world)[1:]:
        if n <= per_node and per_node % n == 0:
            out.append(TuneGroup(tuple(range(n)), "intra"))
        if nodes > 1 and (n <= nodes or n % nodes == 0):
            spread = min(n, nodes)
            each = n // spread
            out.append(TuneGroup(tuple(node * per_node + i for node in range(spread) for i in range(each)), "inter"))
    if per_node >= 2:
        out.append(TuneGroup((0, 1), "intra", p2p=True))
    if nodes > 1:
        out.append(TuneGroup((0, per_node), "inter", p2p=True))
    return out
