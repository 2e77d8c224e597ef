"""The prefix tree over a batch's prompts (BlendServe §5.1): which requests share which prefix.

    keys (token ids or characters, one per request) -> build() -> a radix tree (Node: an
        edge of key units, the requests whose key ends there, children by first unit)
    -> groups(root, min_shared) -> the tree the ordering works on: a Group is a prefix of
       at least min_shared units shared by two or more requests; its entries are the
       requests that end inside it and its sub-groups. Shorter shared prefixes (a chat
       template's opening, a common first word) are ignored: they save less than one KV
       block, and keeping them would tie unrelated requests together.

Plain Python, no I/O; keys are any sequences (str, tuple of ints) compared by element.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence


@dataclasses.dataclass(eq=False)
class Node:
    edge: Sequence            # the key units from the parent to here
    depth: int                # key units from the root to the end of edge
    children: dict = dataclasses.field(default_factory=dict)   # first unit of the child's edge -> Node
    items: list[int] = dataclasses.field(default_factory=list) # requests whose key ends exactly here


@dataclasses.dataclass(eq=False)
class Group:
    depth: int                              # key units every request below shares
    entries: list["Group | int"]            # sub-groups and requests (ints), in insertion order

    def items(self) -> list[int]:
        """Every request below, depth first."""
        out: list[int] = []
        for e in self.entries:
            out += e.items() if isinstance(e, Group) else [e]
        return out


def _common(a: Sequence, b: Sequence) -> int:
    return len(os.path.commonprefix([a, b]))


def build(keys: Sequence[Sequence]) -> Node:
    """The radix tree of keys[i] for every i (request i is recorded where its key ends)."""
    root = Node(edge=(), depth=0)
    for i, key in enumerate(keys):
        node = root
        while True:
            pos = node.depth
            if pos == len(key):
                node.items.append(i)
                break
            child = node.children.get(key[pos])
            if child is None:
                node.children[key[pos]] = Node(edge=key[pos:], depth=len(key), items=[i])
                break
            m = _common(child.edge, key[pos:])
            if m < len(child.edge):   # the key leaves the edge midway: split it there
                mid = Node(edge=child.edge[:m], depth=pos + m)
                child.edge = child.edge[m:]
                mid.children[child.edge[0]] = child
                node.children[key[pos]] = mid
                child = mid
            node = child
    return root


def groups(root: Node, min_shared: int) -> Group:
    """The tree as nested Groups (the root is a Group of depth 0); nodes shallower than
    min_shared dissolve into their parent, a group of one entry is that entry."""
    top = Group(0, _entries(root, min_shared, is_root=True))
    return top


def _entries(node: Node, min_shared: int, is_root: bool = False) -> list[Group | int]:
    inner: list[Group | int] = list(node.items)
    for child in node.children.values():
        inner += _entries(child, min_shared)
    if is_root or node.depth < min_shared or len(inner) <= 1:
        return inner
    return [Group(node.depth, inner)]
