"""The sharding-rule registry: one rule per op or op family, found by the node's target.

A rule has one signature::

    rule(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision

where ``pl`` maps each input node of ``node`` to its placement (a tuple of
placements for a multi-output input). It is registered with a decorator::

    @register_rule(aten.tril.default, aten.triu.default)
    def triangular(ctx, node, pl): ...

under op overloads (``aten.mm.default``), packets (``aten.squeeze``: every
overload), qualified names (``"transformers::grouped_mm_fallback"``: an op of
a library that may not be loaded) or plain callables (``operator.getitem``).
A key can be registered once; ``unregister`` frees it.

Precedence, when several entries could match a target, is fixed and explicit:

1. the target itself (an overload, or a callable),
2. its packet,
3. its qualified name ``namespace::name``,
4. a tag rule (``register_tag``: ``torch.Tag.pointwise``); an op carrying two
   registered tags is an error, not a choice.

No entry: the op has no rule, and runs replicated on gathered inputs when a
split value reaches it (``dispatch.decide``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.core.errors import AutoparError

from passes.rules.context import Ctx
from passes.rules.decision import Decision

__all__ = ["Placements", "Rule", "RuleEntry", "RuleRegistry", "RULES", "register_rule", "register_tag",
           "unregister_rule", "RuleError"]


class RuleError(AutoparError, ValueError):
    """A sharding rule registered wrongly (a bad key, an op or tag that has one already) or two tag
    rules claiming the same op."""

Placements = Mapping[fx.Node, Any]
"""Input node -> its placement (``Placement``, or a tuple of them for a multi-output input)."""

Rule = Callable[[Ctx, fx.Node, Placements], Decision]


@dataclass(frozen=True)
class RuleEntry:
    rule: Rule
    key: Any
    """What the rule was registered under (overload, packet, qualified name, callable or tag)."""
    replicated_inputs: bool = False
    """The rule decides even when every input is replicated (a column-parallel linear, a
    vocabulary-parallel embedding); otherwise such a node is replicated without asking it."""

    def __call__(self, ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
        return self.rule(ctx, node, pl)


def _key(op) -> Any:
    if isinstance(op, str) and "::" not in op:
        raise RuleError(f"a rule's name key is 'namespace::op', not {op!r}")
    return op


def _name_of(target) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


class RuleRegistry:
    """Rules by op key, and tag rules for ops without one."""

    def __init__(self) -> None:
        self._entries: dict[Any, RuleEntry] = {}
        self._tags: dict[torch.Tag, RuleEntry] = {}

    def register(self, *ops, replicated_inputs: bool = False) -> Callable[[Rule], Rule]:
        """Decorator: ``rule`` decides every node whose target is one of ``ops``."""

        def wrap(rule: Rule) -> Rule:
            keys = [_key(op) for op in ops]
            taken = [k for k in keys if k in self._entries]
            if taken:
                raise RuleError(f"{taken} already have a sharding rule "
                                 f"({self._entries[taken[0]].rule.__qualname__}); unregister it first")
            for k in keys:
                self._entries[k] = RuleEntry(rule, k, replicated_inputs)
            return rule

        return wrap

    def register_tag(self, tag: torch.Tag, replicated_inputs: bool = False) -> Callable[[Rule], Rule]:
        """Decorator: ``rule`` decides ops carrying ``tag`` that have no rule of their own."""

        def wrap(rule: Rule) -> Rule:
            if tag in self._tags:
                raise RuleError(f"{tag} already has a sharding rule")
            self._tags[tag] = RuleEntry(rule, tag, replicated_inputs)
            return rule

        return wrap

    def unregister(self, *ops) -> None:
        for op in ops:
            if isinstance(op, torch.Tag):
                del self._tags[op]
            else:
                del self._entries[_key(op)]

    def lookup(self, target) -> RuleEntry | None:
        """The rule for ``target``, by the precedence in the module docstring; None if it has none."""
        for key in self._keys_of(target):
            entry = self._entries.get(key)
            if entry is not None:
                return entry
        if isinstance(target, torch._ops.OpOverload):
            hits = [e for tag, e in self._tags.items() if tag in target.tags]
            if len(hits) > 1:
                raise RuleError(f"{target} carries the tags {[str(e.key) for e in hits]} of several tag rules")
            if hits:
                return hits[0]
        return None

    @staticmethod
    def _keys_of(target) -> Iterator[Any]:
        yield target
        if isinstance(target, torch._ops.OpOverload):
            yield target.overloadpacket
        name = _name_of(target)
        if name is not None:
            yield name

    def keys(self) -> list[Any]:
        """Every op key with a rule of its own (not the tags)."""
        return list(self._entries)

    def tags(self) -> list[torch.Tag]:
        return list(self._tags)

    def entry(self, key) -> RuleEntry:
        """The entry registered under ``key`` (an op key or a tag)."""
        return self._tags[key] if isinstance(key, torch.Tag) else self._entries[_key(key)]


RULES = RuleRegistry()
"""The registry the analysis reads; the rule modules of this package fill it when imported."""

register_rule = RULES.register
register_tag = RULES.register_tag
unregister_rule = RULES.unregister
