"""CPU replay: a row-parallel projection's reduction leaves (``recipes/layers.py`` ``row_linear``) found in a graph and
put on the blocked product (``blocked_linear``), for ``packed_linear.LinearPacks``.

``row_linear`` computes ``x @ W.T`` as L products over equal slices of K, one ``bmm`` over views of ``x`` and the
weight, then adds them as a balanced pairwise tree (``parts[0::2] + parts[1::2]``, the bias first added to leaf 0).
``rewrite_leaves`` replaces the ``bmm`` by ``blocked_linear.graph_leaves`` (each leaf one FMA chain over its slice)
or, where the graph sums the leaves exactly so (``_leaf_tree``), the ``bmm`` and the tree by one
``blocked_linear.graph_row_linear`` (the same additions in the product's registers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import Node

from ignition.catalog.model import BufferDecl
from ignition.runtime.backends import blocked_linear

_EXPAND = torch.ops.aten.expand.default
_TRANSPOSE, _PERMUTE = torch.ops.aten.transpose.int, torch.ops.aten.permute.default
_RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.view.default)
_SLICE, _ADD, _CAT = torch.ops.aten.slice.Tensor, torch.ops.aten.add.Tensor, torch.ops.aten.cat.default
BMM = torch.ops.aten.bmm.default
"""The operator ``row_linear``'s leaves are (``LinearPacks.rewrite`` hands each such node to ``rewrite_leaves``)."""

_FULL = (None, 2**63 - 1)  # a slice's end that keeps the rest


def _slice_of(node, dim: int, start: int, step: int, end=_FULL) -> bool:
    """Whether ``node`` is ``aten.slice.Tensor(input, dim, start, end, step)`` with those values (the end any of
    ``end``)."""
    if not isinstance(node, Node) or node.target is not _SLICE:
        return False
    args = (*node.args[1:], *[None] * 4)[:4]
    got = (0 if args[0] is None else args[0], 0 if args[1] is None else args[1], args[2], 1 if args[3] is None else
           args[3])
    return got[0] == dim and got[1] == start and got[3] == step and got[2] in (end if isinstance(end, tuple)
                                                                               else (end,))


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _leaf_tree(leaves_node: Node, leaves: int) -> tuple[Node, Node | None, list[Node]] | None:
    """``row_linear``'s sum of the leaves ``leaves_node`` (``[L, rows, N]``) as the graph has it: optionally
    ``cat((parts[:1] + bias, parts[1:]))``, then ``parts[0::2] + parts[1::2]`` until one leaf is left. (the last
    node, the bias node or None, every node of the sum in program order), or None where the graph sums otherwise."""
    if leaves < 2 or leaves & (leaves - 1) or leaves > blocked_linear.MAX_TREE_LEAVES:
        return None
    summed: list[Node] = []
    current, bias = leaves_node, None
    users = list(current.users)
    if len(users) == 2 and any(_slice_of(u, 0, 0, 1, 1) for u in users):  # the bias in the first leaf
        first = next((u for u in users if _slice_of(u, 0, 0, 1, 1)), None)
        rest = next((u for u in users if _slice_of(u, 0, 1, 1)), None)
        added = _only_user(first) if first is not None else None
        if rest is None or added is None or added.target is not _ADD or added.args[0] is not first:
            return None
        joined = _only_user(added)
        if joined is None or joined.target is not _CAT or _only_user(rest) is not joined or \
                list(joined.args[0]) != [added, rest] or (len(joined.args) > 1 and joined.args[1] != 0):
            return None
        bias, current = added.args[1], joined
        summed += [first, rest, added, joined]
    for _ in range(leaves.bit_length() - 1):
        users = list(current.users)
        even = next((u for u in users if _slice_of(u, 0, 0, 2)), None)
        odd = next((u for u in users if _slice_of(u, 0, 1, 2)), None)
        if len(users) != 2 or even is None or odd is None:
            return None
        added = _only_user(even)
        if added is None or _only_user(odd) is not added or added.target is not _ADD or \
                tuple(added.args) != (even, odd):
            return None
        summed += [even, odd, added]
        current = added
    return current, bias, summed


def rewrite_leaves(graph, node: Node, weight_of: dict[Node, str], decls: dict[str, BufferDecl],
                   claim: Callable[[str, torch.dtype], bool], packed_weight: Callable[[str], Node]) -> int:
    """A row-parallel projection's leaves (``recipes/layers.py`` ``row_linear``: ``bmm`` of ``x.reshape(-1, L,
    K / L).transpose(0, 1)`` and ``w.view(N, L, K / L).permute(1, 2, 0)``, or a one-leaf shard's two copies of
    them) onto ``blocked_linear.blocked_leaves``, whose leaves are each one FMA chain, and where the graph sums
    them as ``row_linear`` does (``_leaf_tree``), the leaves and their sum onto ``blocked_row_linear`` (the same
    additions, in the product's registers): 1 where rewritten.

    ``claim(weight name, dtype)``: whether that weight's leaves may go on the blocked product (``LinearPacks``: FP32,
    the product built, the mode ``calibrate`` or ``blocked``; not timed per shape, since a tensor-parallel rank
    computes some of the same leaves on its shard's shape and they must be the single rank's bits)."""
    expanded = False
    leaves_view, slices = node.args
    if not isinstance(leaves_view, Node) or not isinstance(slices, Node):
        return 0
    if leaves_view.target is _EXPAND and slices.target is _EXPAND:  # a rank's one leaf as a batch of two
        if list(leaves_view.args[1])[0] != 2 or list(slices.args[1])[0] != 2:
            return 0
        expanded, leaves_view, slices = True, leaves_view.args[0], slices.args[0]
    if leaves_view.target is not _TRANSPOSE or tuple(leaves_view.args[1:]) != (0, 1) or \
            slices.target is not _PERMUTE or list(slices.args[1]) != [1, 2, 0]:
        return 0
    flat, view = leaves_view.args[0], slices.args[0]
    if flat.target not in _RESHAPES or view.target not in _RESHAPES or view.args[0] not in weight_of or \
            len(view.args[1]) != 3:
        return 0
    name = weight_of[view.args[0]]
    decl = decls[name]
    out_features, in_features = decl.shape
    leaves = list(view.args[1])[1]
    if list(view.args[1]) != [out_features, leaves, in_features // leaves] or \
            list(flat.args[1])[1:] != [leaves, in_features // leaves] or in_features % leaves or \
            not claim(name, decl.torch_dtype):
        return 0
    tree = None if expanded else _leaf_tree(node, leaves)
    if tree is not None:  # the leaves and their sum, one call
        end, bias, summed = tree
        with graph.inserting_before(end):
            call = graph.call_function(blocked_linear.graph_row_linear,
                                       (flat.args[0], packed_weight(name), bias, out_features, leaves))
        call.meta = dict(end.meta)
        end.replace_all_uses_with(call)
        for unused in reversed(summed):  # each one's users before it
            graph.erase_node(unused)
    else:
        with graph.inserting_before(node):
            call = graph.call_function(blocked_linear.graph_leaves,
                                       (flat.args[0], packed_weight(name), out_features, leaves))
            result = graph.call_function(_EXPAND, (call, [2, -1, -1])) if expanded else call
        result.meta = dict(node.meta)
        if expanded and "val" in node.meta:
            call.meta = {**node.meta, "val": node.meta["val"][:1]}
        node.replace_all_uses_with(result)
    copies = node.args if expanded else ()
    graph.erase_node(node)
    for unused in (*copies, leaves_view, slices, flat, view):  # in order: each one's users erased before it
        if not unused.users:
            graph.erase_node(unused)
    return 1


__all__ = ["BMM", "rewrite_leaves"]
