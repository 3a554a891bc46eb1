"""Per-op sharding rules over the ATen ops of transformer graphs, one registry.

``decide(ctx, node, placement_of)`` finds the rule for the node's target in
``registry.RULES`` and returns its ``Decision``: the placement of the output
and what the rewrite puts around the op. The modules, one job each:

- ``registry``    the registry: ``@register_rule(op, ...)``, lookup and its precedence
- ``dispatch``    ``decide``: replicated nodes, fallbacks, parameters read whole
- ``decision``    ``Decision`` and what a rewrite inserts
- ``context``     ``Ctx`` and how a rule reads a node's operands
- ``pointwise``   element-wise ops (by ``torch.Tag.pointwise``), copies, concatenation
- ``views``       the dimension-map table: views, ops along dims, reductions
- ``reshape``     view/reshape/flatten/expand, split and slice of the split dim
- ``reductions``  sums and means over the split dim, normalizations
- ``einsum``      contractions as einsum equations, one rule for all of them
- ``matmul``      linears with a weight parameter (column/row-parallel), products
- ``attention``   scaled dot-product attention
- ``vocab``       vocabulary-parallel embedding, losses and softmax family

Importing this package registers every rule. ``docs/adding-an-op.md`` says how
to add one.
"""

from passes.rules import attention, matmul, pointwise, reductions, reshape, views, vocab  # noqa: F401  (they register)
from passes.rules.context import Ctx
from passes.rules.decision import Decision, NeedSegments, Rewrite
from passes.rules.dispatch import decide
from passes.rules.matmul import LinearParts, linear_parts, out_features, weight_of
from passes.rules.registry import RULES, register_rule, unregister_rule

__all__ = ["Ctx", "Decision", "NeedSegments", "Rewrite", "decide", "LinearParts", "linear_parts", "out_features",
           "weight_of", "RULES", "register_rule", "unregister_rule"]
