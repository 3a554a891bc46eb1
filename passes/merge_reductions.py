"""One all-reduce for a sum of row-parallel outputs (parallel attention and MLP blocks).

In a block that runs attention and the MLP side by side (GPT-J, GPT-NeoX,
Falcon, Phi, Cohere, ...), the layer's output is
``attn_out + mlp_out + residual`` where both ``attn_out`` and ``mlp_out``
come out of row-parallel linears: after the rewrite each is ``g(partial)``,
maybe plus its bias. Summation is linear, so

    g(a) + b1 + g(c) + b2 + r   ==   g(a + c) + b1 + b2 + r

with one all-reduce instead of two, the same gradients (g's backward is the
identity: ``a`` and ``c`` get the gradient of the sum, the biases theirs, as
before). This pass finds trees of additions (each intermediate sum used once)
with two or more such leaves and rewrites them so; the remaining leaves are
added after, in their order. The reassociation changes only the rounding of
the sum.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.core import comm

aten = torch.ops.aten

__all__ = ["merge_parallel_reductions"]


def _is_add(n) -> bool:
    """``a + b`` of two tensors; also ``a += b`` when ``a`` is a fresh result of an all-reduce or an
    out-of-place add read by nothing else (not a view of something read later): then it is the same."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and len(n.args) == 2 and not n.kwargs
            and all(isinstance(a, fx.Node) for a in n.args)):
        return False
    if n.target == aten.add.Tensor:
        return True
    a = n.args[0]
    return (n.target == aten.add_.Tensor and len(a.users) == 1 and a.op == "call_function"
            and (a.target is comm.reduce_from_tp or a.target == aten.add.Tensor))


def _leaves(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(leaves, inner additions) of the addition tree rooted at ``node``."""
    leaves, inner, todo = [], [], list(node.args)
    while todo:
        a = todo.pop(0)
        if _is_add(a) and len(a.users) == 1:
            inner.append(a)
            todo[:0] = list(a.args)
        else:
            leaves.append(a)
    return leaves, inner


def _reduced(leaf: fx.Node, shape) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(the reduction, its partial input, bias or None) if ``leaf`` is ``g(p)`` or ``g(p) + bias``
    used only here, with p of the tree's full shape."""
    bias = None
    red = leaf
    if _is_add(leaf) and leaf.args[0].op == "call_function" and leaf.args[0].target is comm.reduce_from_tp:
        red, bias = leaf.args
        if len(red.users) != 1 or len(leaf.users) != 1:
            return None
    if red.op != "call_function" or red.target is not comm.reduce_from_tp or len(red.users) != 1:
        return None
    partial = red.args[0]
    val = partial.meta.get("val")
    if val is None or tuple(val.shape) != shape:
        return None
    return red, partial, bias


def merge_parallel_reductions(graph: fx.Graph) -> int:
    """Rewrite ``graph`` in place; returns the number of all-reduces removed."""
    removed = 0
    for node in list(graph.nodes):
        if node.graph is not graph or not _is_add(node):
            continue
        if len(node.users) == 1 and _is_add(next(iter(node.users))):
            continue  # not the root of its tree: handled from the root
        val = node.meta.get("val")
        if val is None:
            continue
        shape = tuple(val.shape)
        leaves, inner = _leaves(node)
        found = [(leaf, r) for leaf in leaves if (r := _reduced(leaf, shape)) is not None]
        if len(found) < 2 or len({r[0].args[1] for _, r in found}) != 1:  # one tp group
            continue
        tp = found[0][1][0].args[1]
        merged = {leaf for leaf, _ in found}
        dtype = val.dtype  # the sum's type as traced: under autocast, bf16 partials are summed in it
        with graph.inserting_before(node):
            parts = [_like(graph.call_function(aten.to.dtype, (p, dtype)), node) for _, (_, p, _) in found]
            total = parts[0]
            for part in parts[1:]:
                total = _like(graph.call_function(aten.add.Tensor, (total, part)), node)
            out = _like(graph.call_function(comm.reduce_from_tp, (total, tp)), node)
            for _, (_, _, bias) in found:
                if bias is not None:
                    out = _like(graph.call_function(aten.add.Tensor, (out, bias)), node)
            for leaf in leaves:
                if leaf not in merged:
                    out = _like(graph.call_function(aten.add.Tensor, (out, leaf)), node)
        node.replace_all_uses_with(out)
        # erase the old tree explicitly: an in-place add (+=) is not dead code to fx
        stale = [node, *inner] + [n for leaf, (red, _, _) in found for n in (leaf, red)]
        for n in dict.fromkeys(stale):
            if not n.users:
                graph.erase_node(n)
        removed += len(found) - 1
    graph.eliminate_dead_code()
    return removed


def _like(new: fx.Node, node: fx.Node) -> fx.Node:
    for key in ("nn_module_stack", "stack_trace", "val"):
        if key in node.meta:
            new.meta[key] = node.meta[key]
    return new
