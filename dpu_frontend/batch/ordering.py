"""The order a batch is submitted in: the file's, or BlendServe's (seed 002, §4-5, Algorithms 1 and 3).

    [Work] (prefix key, prompt tokens, output tokens) -> plan(works, "file" | "blend") -> Plan

    file:  the input file's order, nothing held back.
    blend: 1. a prefix tree over the keys (prefix_tree.py), prefixes of >= min_shared units;
           2. each request's cost (CostModel, BlendServe §4.1): compute time (prefill of its
              uncached prompt plus one token per output) and memory time (every decode step
              reads its KV and a share of the weights); a shared prefix's prefill is split
              evenly between the requests sharing it (the (1 - s) of §5.1);
           3. layer-wise sort (Algorithm 1): at every node, sub-groups and requests in
              descending compute density rho = compute / memory; the tree stays whole, so
              prefix groups stay together (depth-first leaf order);
           4. dual scan (§5.3): the leaf order is consumed from both ends, the left end
              (compute-heavy: long prompts, short outputs) and the right end (memory-heavy:
              long outputs), taking from the left while what has been taken is lighter in
              compute than the whole batch (rho(taken) < rho(root)) and from the right
              otherwise. Every stretch of the order then mixes both kinds in the batch's
              own proportion, which is what the running batch sees at every step when the
              runner keeps a bounded number of requests in flight. The first pick comes
              from the right: long decodes start first, not last.
           5. prefix leaders: in each top-level prefix group the request with the fewest
              output tokens moves to the group's first position in the order and the rest
              of its group wait for it to finish (Plan.leader_of), so its prefill fills the
              server's prefix cache before the others are sent (BlendServe computes a
              shared prefix exactly once per batch; a server computes it once per request
              admitted in the same step).
    Steps 2 and 5 assume the server keeps a prefix cache (prefix_cache=True). Without one,
    every request pays its whole prompt (a group of long shared prompts is compute-heavy,
    not cheap) and nobody waits for a leader: measured on blink serve before it had a prefix
    cache, assuming one put every prefix group at the end of the order, unblended, and made
    the batch 0.69x slower than the file's order (bench/results/2026-11-25-*-batch-order).
    The memory partition of Algorithm 3 is done by the running ratio of step 4; node
    splitting (Algorithm 2) is left out: groups are never broken to move an outlier.

Deterministic (ties break on the file position), pure, no I/O.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .prefix_tree import Group, build, groups

ORDERS = ("blend", "file")


@dataclasses.dataclass(frozen=True)
class Work:
    key: Sequence           # the prompt as the prefix tree sees it: token ids or characters
    prompt_tokens: int      # the prompt's length in tokens (len(key) when key is tokens)
    output_tokens: int      # max_tokens (times n): the decode length to expect


@dataclasses.dataclass(frozen=True)
class CostModel:
    """BlendServe's per-request model (§4.1), with the embedded SmolLM2-135M on the 2-core box as
    the default: the numbers matter only through the ratio compute / memory, which ranks requests.
    One term is added to the paper's Mem(r): each decode step also streams the weights, shared by
    `batch` requests (the paper's GPU batches are large enough to drop it; a CPU's are not)."""
    params: float = 135e6            # P_model
    hidden: int = 576                # H
    layers: int = 30                 # L
    kv_bytes_per_token: float = 46080.0   # K and V, all layers: 2 * 30 * 3 heads * 64 * 4 bytes
    flops_per_s: float = 40e9        # prefill rate (~130 tokens/s at 2 * P flops a token)
    bytes_per_s: float = 18e9        # memory bandwidth (triad, bench/results)
    weight_bytes: float = 92e6       # weights one decode step reads (Q4_1 layers, Q8_0 head)
    batch: int = 16                  # requests sharing a decode step's weight reads

    def compute_s(self, computed_tokens: float, prompt_tokens: int, output_tokens: int) -> float:
        """GEMMs over the computed prompt tokens and every output token, plus prefill attention."""
        flops = (2 * (computed_tokens + output_tokens) * self.params
                 + 4 * computed_tokens * prompt_tokens * self.hidden * self.layers)
        return flops / self.flops_per_s

    def memory_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """Each of d decode steps reads the KV of p + i tokens, and 1/batch of the weights."""
        p, d = prompt_tokens, output_tokens
        kv_bytes = (p * d + d * d / 2) * self.kv_bytes_per_token
        return (kv_bytes + d * self.weight_bytes / self.batch) / self.bytes_per_s


@dataclasses.dataclass(frozen=True)
class Plan:
    order: tuple[int, ...]              # request indices, submission order; each exactly once
    leader_of: dict[int, int] = dataclasses.field(default_factory=dict)   # request -> the one it waits for

    def leaders(self) -> set[int]:
        return set(self.leader_of.values())


def plan(works: Sequence[Work], order: str = "blend", min_shared: int = 32,
         cost: CostModel = CostModel(), prefix_cache: bool = True) -> Plan:
    """The submission plan for works[0..n-1]. min_shared: the shortest prefix (in key units)
    that counts as shared. prefix_cache=False (a server that prefills every prompt in full):
    every request pays its whole prompt in the costs, and nobody waits for a leader."""
    if order == "file":
        return Plan(tuple(range(len(works))))
    if order != "blend":
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if not works:
        return Plan(())
    root, comp, mem = sorted_tree(works, min_shared, cost, prefix_cache)
    sequence = _dual_scan(root.items(), comp, mem)
    return _with_leaders(sequence, root, works) if prefix_cache else Plan(tuple(sequence))


def sorted_tree(works: Sequence[Work], min_shared: int = 32, cost: CostModel = CostModel(),
                prefix_cache: bool = True) -> tuple[Group, list[float], list[float]]:
    """Steps 1-3: the prefix tree sorted by density (its items() are the dual scan's input, compute
    side first), and every request's compute and memory seconds."""
    root = groups(build([w.key for w in works]), min_shared)
    comp, mem = _costs(root if prefix_cache else Group(0, list(range(len(works)))), works, cost)
    _sort(root, comp, mem)
    return root, comp, mem


def _costs(root: Group, works: Sequence[Work], cost: CostModel) -> tuple[list[float], list[float]]:
    """Per request: compute seconds (its share of every shared prefix, all of its own part) and
    memory seconds."""
    n = len(works)
    computed = [0.0] * n     # prompt tokens each request pays to prefill

    def scale(i: int) -> float:   # tokens per key unit (1 when keys are tokens)
        return works[i].prompt_tokens / len(works[i].key) if len(works[i].key) else 0.0

    def walk(group: Group, parent_depth: int) -> None:
        below = group.items()
        for i in below:   # the units this group adds over its parent, split between its requests
            computed[i] += (group.depth - parent_depth) * scale(i) / len(below)
        for e in group.entries:
            if isinstance(e, Group):
                walk(e, group.depth)
            else:   # the request's own part after the innermost shared prefix
                computed[e] += max(0.0, works[e].prompt_tokens - group.depth * scale(e))

    walk(root, 0)
    comp = [cost.compute_s(computed[i], w.prompt_tokens, w.output_tokens) for i, w in enumerate(works)]
    mem = [cost.memory_s(w.prompt_tokens, w.output_tokens) for w in works]
    return comp, mem


def _density(c: float, m: float) -> float:
    return c / m if m > 0 else float("inf")


def _sort(group: Group, comp: list[float], mem: list[float]) -> tuple[float, float, int]:
    """Algorithm 1: children by descending density at every level; returns (compute, memory,
    first file position) of the group for its parent's sort."""
    keyed = []
    for e in group.entries:
        if isinstance(e, Group):
            c, m, first = _sort(e, comp, mem)
        else:
            c, m, first = comp[e], mem[e], e
        keyed.append((-_density(c, m), first, e, c, m))
    keyed.sort(key=lambda k: (k[0], k[1]))
    group.entries = [k[2] for k in keyed]
    return sum(k[3] for k in keyed), sum(k[4] for k in keyed), min(k[1] for k in keyed)


def _dual_scan(leaves: list[int], comp: list[float], mem: list[float]) -> list[int]:
    """Take from the compute-heavy left end while the taken mix is below the batch's density,
    else from the memory-heavy right end; the pointers meet when every request is taken."""
    target = _density(sum(comp), sum(mem))
    left, right = 0, len(leaves) - 1
    taken_c = taken_m = 0.0
    out = []
    while left <= right:
        if taken_m > 0 and taken_c < target * taken_m:
            i = leaves[left]
            left += 1
        else:
            i = leaves[right]
            right -= 1
        out.append(i)
        taken_c += comp[i]
        taken_m += mem[i]
    return out


def _with_leaders(sequence: list[int], root: Group, works: Sequence[Work]) -> Plan:
    """Step 5: per top-level group, its leader takes the group's earliest position; the others
    wait for it."""
    position = {i: p for p, i in enumerate(sequence)}
    order = list(sequence)
    leader_of: dict[int, int] = {}
    for e in root.entries:
        if not isinstance(e, Group):
            continue
        members = e.items()
        leader = min(members, key=lambda i: (works[i].output_tokens, i))
        first = min(members, key=position.__getitem__)
        a, b = position[leader], position[first]
        order[a], order[b] = order[b], order[a]
        position[leader], position[first] = b, a
        leader_of.update({i: leader for i in members if i != leader})
    return Plan(tuple(order), leader_of)
