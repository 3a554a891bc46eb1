"""Put a traced graph into the few forms the sharding analysis reads.

Models write the same computation in different ways, and torch.export keeps
the difference. Before the analysis, this pass:

- **drops dropouts of probability 0** (configs often leave them in): they
  are the identity, and without them a sum of row-parallel outputs is seen
  as one (``passes/merge_reductions.py``);
- **drops dtype/shape assertions** (``aten._assert_tensor_metadata``, which
  export records for every ``.to(dtype)``): they check the *global* shape and
  would fail on a shard; they have no users and compute nothing;
- **turns an einsum that is a linear into one**: ``einsum("...k,nk->...n", x, W)``
  becomes ``linear(x, W)``, and ``einsum("...k,kn->...n", x, W)`` ``x @ W``
  (W a 2-D parameter; any letters for the leading dims, or ``...``);
- **turns a matmul with a transposed weight into a linear**:
  ``x @ W.T`` (``matmul``/``mm`` of ``t``/``numpy_T``/``transpose(0, 1)``/
  ``permute([1, 0])`` of a 2-D parameter, as Falcon's and other custom linear
  layers write it) becomes ``aten.linear(x, W)``, and a following ``+ b``
  with a 1-D parameter of the output width becomes its bias. The analysis
  then sees an ``nn.Linear`` and can split it column- or row-wise;
- **counts integers in floats**: ``histc`` of an integer tensor (an MoE's
  tokens per expert, as a model traced on the meta device writes it for a
  GPU) becomes ``histc`` of its float values, which every device's kernel
  takes (CPU has no integer ``histc``). Small integers are exact in float32.

The graph computes the same values (``linear`` is the same GEMM with a
transposed operand), so parity with the user's model is unchanged.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

__all__ = ["normalize"]

_ASSERTS = {aten._assert_tensor_metadata.default}


def _transposed_param(n, params: set[str]) -> fx.Node | None:
    """The 2-D parameter ``W`` if ``n`` is ``W.T`` (in any of its spellings), else None."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return None
    w = n.args[0] if n.args else None
    if not (isinstance(w, fx.Node) and w.op == "placeholder" and w.name in params):
        return None
    if w.meta["val"].dim() != 2:
        return None
    target = n.target
    if target in (aten.t.default, aten.numpy_T.default):
        return w
    if target == aten.transpose.int and sorted(d % 2 for d in n.args[1:3]) == [0, 1]:
        return w
    if target == aten.permute.default and [d % 2 for d in n.args[1]] == [1, 0]:
        return w
    return None


def _bias_add(mm: fx.Node, out_features: int, params: set[str]) -> tuple[fx.Node, fx.Node] | None:
    """(add node, bias parameter) when ``mm``'s only user is ``mm + b`` with b 1-D of the output width."""
    if len(mm.users) != 1:
        return None
    add = next(iter(mm.users))
    if add.op != "call_function" or add.target != aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return None
    b = add.args[1] if add.args[0] is mm else add.args[0]
    if not (isinstance(b, fx.Node) and b.op == "placeholder" and b.name in params):
        return None
    if tuple(b.meta["val"].shape) != (out_features,):
        return None
    return add, b


def _einsum_linear(g: fx.Graph, node: fx.Node, params: set[str]) -> bool:
    """Rewrite ``einsum(x, W)`` that contracts x's last dim with a 2-D parameter as linear/matmul."""
    eq, ops = node.args[0], node.args[1]
    if len(ops) != 2 or "->" not in eq:
        return False
    x, w = ops
    if not (isinstance(w, fx.Node) and w.op == "placeholder" and w.name in params and w.meta["val"].dim() == 2):
        return False
    ins, out = eq.replace(" ", "").replace("...", "#").split("->")  # '#': the leading dims, as one letter
    xs, ws = ins.split(",")
    if len(ws) != 2 or not xs or not out:
        return False
    k = xs[-1]
    lead = xs[:-1]
    if k not in ws or len(set(xs)) != len(xs):
        return False
    n = ws[1] if ws[0] == k else ws[0]
    if n == k or n in lead or out != lead + n:
        return False
    target, args = (aten.linear.default, (x, w)) if ws == n + k else (aten.matmul.default, (x, w))
    with g.inserting_before(node):
        new = g.call_function(target, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return True


def normalize(gm: fx.GraphModule, param_names: set[str]) -> dict[str, int]:
    """Rewrite ``gm`` in place; returns how many nodes of each kind were rewritten."""
    g = gm.graph
    done = {"assertions dropped": 0, "zero dropouts dropped": 0, "x @ W.T made linear": 0, "integer histc in floats": 0}
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten.dropout.default and len(node.args) >= 2 and node.args[1] == 0:
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
            done["zero dropouts dropped"] += 1
            continue
        if node.target in _ASSERTS and not node.users:
            g.erase_node(node)
            done["assertions dropped"] += 1
            continue
        if node.target == aten.histc.default and not node.args[0].meta["val"].dtype.is_floating_point:
            with g.inserting_before(node):
                values = g.call_function(aten._to_copy.default, (node.args[0],), {"dtype": torch.float32})
            values.meta = {**node.args[0].meta, "val": node.args[0].meta["val"].float()}
            node.replace_input_with(node.args[0], values)
            node.meta["val"] = node.meta["val"].float()
            done["integer histc in floats"] += 1
            continue
        if node.target == aten.einsum.default:
            if _einsum_linear(g, node, param_names):
                done["x @ W.T made linear"] += 1
            continue
        if node.target not in (aten.matmul.default, aten.mm.default) or len(node.args) != 2:
            continue
        x, wt = node.args
        w = _transposed_param(wt, param_names)
        if w is None or not isinstance(x, fx.Node) or x.meta["val"].dim() < 1:
            continue
        out_features = w.meta["val"].shape[0]
        bias = _bias_add(node, out_features, param_names)
        anchor = bias[0] if bias else node
        with g.inserting_before(anchor):
            args = (x, w, bias[1]) if bias else (x, w)
            lin = g.call_function(aten.linear.default, args)
        lin.meta = dict(node.meta)  # the linear's module path and source line
        lin.meta["val"] = anchor.meta["val"]
        lin.meta.update({k: v for k, v in anchor.meta.items() if k not in node.meta})  # marks on the bias add
        anchor.replace_all_uses_with(lin)
        g.erase_node(anchor)
        if bias:
            g.erase_node(node)
        if not wt.users:
            g.erase_node(wt)
        done["x @ W.T made linear"] += 1
    g.lint()
    gm.recompile()
    return done
