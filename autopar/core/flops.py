"""FLOPs and bytes: the contraction formulas and the per-node roofline cost of a graph node.

Matrix products count 2*M*N*K FLOPs, attention 4*B*H*Tq*Tk*d (scores and
weighted sum), a collective fused with GEMMs those of its GEMMs (its
registered ``flops``), everything else one FLOP per output element. Bytes are what
the node writes plus the parameters it reads. ``node_cost`` is a roofline:
max(FLOPs, FLOPS_PER_BYTE * bytes), in FLOP units, so memory-bound ops
(norms, element-wise, softmax) weigh what they cost on a GPU instead of
almost nothing. The pipeline cut balances chunks with it; the plan counts
activation bytes with ``node_bytes``; the cost model uses the formulas.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from autopar.core.collectives import collective_of
from autopar.core.graph import local_val

__all__ = ["matmul_flops", "attention_flops", "node_flops", "node_bytes", "node_cost", "FLOPS_PER_BYTE"]


def matmul_flops(batch: int, m: int, n: int, k: int) -> float:
    """C (batch, m, n) = A (batch, m, k) @ B (batch, k, n): 2 batch m n k."""
    return 2.0 * batch * m * n * k


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int) -> float:
    """Q K^T and P V: 4 b a s_q s_k d (Megatron computes the full square, causal or not)."""
    return 4.0 * batch * heads * seq_q * seq_k * head_dim


# Machine balance of an A100 (312 TFLOP/s bf16 over ~2 TB/s HBM): an op doing fewer
# FLOPs per byte moved than this is memory-bound.
FLOPS_PER_BYTE = 150.0

aten = torch.ops.aten


def _shape(n) -> tuple[int, ...]:
    v = local_val(n) if isinstance(n, fx.Node) else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else ()


def node_flops(node: fx.Node) -> float:
    """Forward FLOPs of a node (backward is about twice this)."""
    if node.op != "call_function":
        return 0.0
    target = node.target
    fused = collective_of(target)
    if fused is not None and fused.flops is not None:  # a collective decomposed with its GEMMs
        return float(fused.flops(node))
    out = _shape(node)
    if target in (aten.linear.default, aten.mm.default, aten.matmul.default, aten.bmm.default, aten.addmm.default):
        a = node.args[1] if target == aten.addmm.default else node.args[0]
        k = _shape(a)[-1] if _shape(a) else 0
        rows = math.prod(out[:-1]) if out else 0
        return float(matmul_flops(1, rows, out[-1] if out else 0, k))
    if target == aten.scaled_dot_product_attention.default:
        q, kk = _shape(node.args[0]), _shape(node.args[1])
        if len(q) == 4 and len(kk) == 4:
            return float(attention_flops(q[0], q[1], q[2], kk[2], q[3]))
    val = local_val(node)
    if isinstance(val, torch.Tensor):
        return float(val.numel())
    return 0.0


def node_bytes(node: fx.Node) -> float:
    """Bytes a node writes (its output; one rank's on a rank graph); for a collective fused with
    several GEMMs, the outputs of all of them."""
    val = local_val(node)
    if isinstance(val, torch.Tensor):
        return float(val.numel() * val.element_size())
    if isinstance(val, (tuple, list)) and collective_of(node.target) is not None:
        return float(sum(v.numel() * v.element_size() for v in val if isinstance(v, torch.Tensor)))
    return 0.0


def node_cost(node: fx.Node, params: set[str] = frozenset()) -> float:
    """Roofline cost in FLOP units: max(FLOPs, FLOPS_PER_BYTE * (bytes written + parameter bytes read))."""
    if node.op != "call_function":
        return 0.0
    moved = node_bytes(node) + sum(node_bytes(a) for a in node.all_input_nodes if a.name in params)
    return max(node_flops(node), FLOPS_PER_BYTE * moved)
