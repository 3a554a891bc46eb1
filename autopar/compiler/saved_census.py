"""What a traced model keeps for its backward, per token: a census of the tensors autograd saves.

The activation formulas of the cost model (``planning/cost/activations.py``) count the tensors of
the paper's GPT layer (Korthikanti et al. 2022). A model written otherwise keeps other tensors: an
RMSNorm written as ``x * rsqrt(mean(x^2) + eps) * w`` keeps its input, the normalised product and
the rsqrt where a LayerNorm kernel keeps its input and two statistics; rotary positions keep their
cos and sin; an eager SwiGLU keeps the gate's output, the up projection's, SiLU's and their product.
Rather than a formula per family, ``saved_census`` runs the traced graph once under fake tensors
(no memory, no FLOPs) with saved-tensor hooks and counts what each part of the model saves, each
storage once (a view saved beside its base keeps one storage alive).

Each saved storage is charged to the part whose node saved it: layer 0 (``find_layers``), the
embedding (nodes before the layers) or the head (nodes after them). It is classed by the node that
made it, which is what a tensor-parallel layout does to it:

- ``split``: made inside a column-parallel region, between the attention's input projections and
  its output projection, between the MLP's up projections and its down projection, or after the LM
  head (the vocabulary-parallel logits and their softmax): 1/t of it on each of t ranks;
- ``seq``: made from the hidden stream outside those regions (the norms' inputs, outputs and
  statistics, the projections' inputs): whole on every tensor-parallel rank, 1/t of the tokens
  with sequence parallelism;
- ``whole``: made from positions, constants or the batch's ids alone (rotary cos and sin, the
  token and target ids): whole on every rank whatever the layout.

Floating-point storages are counted in elements (the layout's activation byte size prices them),
the others in bytes (ids, masks). Per token: divided by the example's batch x sequence tokens.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.core.graph import ancestors, descendants
from autopar.planning.cost.saved_shares import SavedCensus, SavedShare

__all__ = ["saved_census", "split_regions"]


def split_regions(pairs: list[tuple[list[fx.Node], fx.Node]]) -> set[fx.Node]:
    """The nodes of the column-parallel regions: for each (column projections, row projection) pair,
    the projections and what they make, up to the row projection's input (its output is summed
    over the ranks: whole again)."""
    out: set[fx.Node] = set()
    for columns, row in pairs:
        out |= descendants(columns) & (ancestors(row.all_input_nodes))
    return out


def saved_census(gm: fx.GraphModule, node_layer: dict[str, int], params: set[str], regions: set[fx.Node],
                 head: fx.Node | None, hidden_roots: list[fx.Node], tokens: int) -> SavedCensus:
    """Run ``gm`` under fake tensors with saved-tensor hooks and count, per token, the storages layer 0,
    the embedding and the head save (the module's docstring). ``regions``: the layers' column-parallel
    nodes (``split_regions``); ``head``: the LM head projection (what it makes is vocabulary-parallel);
    ``hidden_roots``: the nodes the hidden stream starts from (the embedding lookups); ``tokens``: the
    example's batch x sequence. Parameters are weights, not activations: never counted."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    layer_nodes = [n for n in nodes if n.name in node_layer]
    first, last = (order[layer_nodes[0]], order[layer_nodes[-1]]) if layer_nodes else (0, -1)
    vocab_split = descendants([head]) if head is not None else set()
    hidden = descendants(hidden_roots)
    producer: dict[int, fx.Node] = {}  # storage -> the node that made it
    kept: list[torch.Tensor] = []  # the census's tensors, alive so that no storage address is reused
    counts: dict[str, dict[int, tuple[str, float, bool]]] = {"layer": {}, "embedding": {}, "head": {}}
    current: list[fx.Node | None] = [None]

    def part_of(n: fx.Node) -> str | None:
        layer = node_layer.get(n.name)
        if layer is not None:
            return "layer" if layer == 0 else None
        return "embedding" if order[n] < first else "head" if order[n] > last else None

    def kind_of(n: fx.Node) -> str:
        if n in regions or n in vocab_split:
            return "split"
        return "seq" if n in hidden else "whole"

    def pack(t: torch.Tensor) -> torch.Tensor:
        node = current[0]
        storage = t.untyped_storage()
        key = storage._cdata
        if node is None or key in param_storages:
            return t
        part = part_of(node)
        if part is not None and key not in counts[part]:
            made_by = producer.get(key, node)
            floating = t.dtype.is_floating_point
            size = storage.nbytes() / t.element_size() if floating else storage.nbytes()
            counts[part][key] = (kind_of(made_by), size, floating)
            kept.append(t)
        return t

    class Census(fx.Interpreter):
        def run_node(self, n: fx.Node):
            current[0] = n
            out = super().run_node(n)
            for v in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(v, torch.Tensor):
                    producer.setdefault(v.untyped_storage()._cdata, n)
                    kept.append(v)
            return out

    with FakeTensorMode(allow_non_fake_inputs=True):
        args = []
        for ph in (n for n in nodes if n.op == "placeholder"):
            val = ph.meta["val"]
            x = torch.empty(tuple(val.shape), dtype=val.dtype, device=val.device)
            if ph.name in params:
                x.requires_grad_(True)
            args.append(x)
        param_storages = {a.untyped_storage()._cdata for a, ph in zip(args, (n for n in nodes if n.op == "placeholder"))
                          if ph.name in params}
        kept += args
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            Census(gm).run(*args)

    def share(part: str) -> SavedShare:
        sums = {"split": 0.0, "seq": 0.0, "whole": 0.0}
        fixed = {"split": 0.0, "seq": 0.0, "whole": 0.0}
        for kind, size, floating in counts[part].values():
            (sums if floating else fixed)[kind] += size
        kinds = ("split", "seq", "whole")
        return SavedShare(*(sums[k] / tokens for k in kinds), fixed=tuple(fixed[k] / tokens for k in kinds))

    return SavedCensus(share("layer"), share("embedding"), share("head"))
