"""The submission order: the prefix tree, BlendServe's density sort and dual scan, prefix-group leaders."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_frontend.batch.ordering import Work, plan, sorted_tree
from dpu_frontend.batch.prefix_tree import Group, build, groups

SYS_A = "A" * 200
SYS_B = "B" * 200


def test_prefix_tree_splits_edges_where_keys_part_and_records_every_key():
    root = build(["abcd", "abxy", "abcd", "ab", "zz"])
    ab = root.children["a"]
    assert ab.edge == "ab" and ab.depth == 2 and ab.items == [3]
    assert root.children["a"].children["c"].items == [0, 2]
    assert root.children["a"].children["x"].items == [1]
    assert root.children["z"].items == [4]
    assert sorted(groups(root, min_shared=1).items()) == [0, 1, 2, 3, 4]


def test_prefixes_shorter_than_min_shared_do_not_make_groups():
    keys = ["hello " + SYS_A + "1", "hello " + SYS_A + "2", "hello " + SYS_B + "1", "hello there"]
    top = groups(build(keys), min_shared=32)
    inner = [e for e in top.entries if isinstance(e, Group)]
    assert sorted(sorted(g.items()) for g in inner) == [[0, 1]]   # "hello " (6 units) ties nothing together
    assert sorted(e for e in top.entries if not isinstance(e, Group)) == [2, 3]


def test_file_order_is_the_file():
    works = [Work("x", 1, 1)] * 5
    p = plan(works, "file")
    assert p.order == (0, 1, 2, 3, 4) and p.leader_of == {}


def test_blend_alternates_long_outputs_and_long_prompts_starting_with_the_longest_output():
    long_prompt = [Work(f"document {k} " + "x" * 600, 600, 8) for k in range(6)]
    long_output = [Work(f"story {k}", 10, 200 + k) for k in range(6)]
    works = long_prompt + long_output
    order = plan(works, "blend").order
    kinds = "".join("P" if i < 6 else "O" for i in order)
    assert order[0] == 11   # the longest decode starts first, not last
    assert all("P" in kinds[k:k + 3] and "O" in kinds[k:k + 3] for k in range(len(kinds) - 2)), kinds


def test_prefix_groups_stay_together_and_wait_for_their_shortest_member():
    # two groups of equal shape (both compute-side), interleaved in the file, and long decodes
    works = []
    for k in range(4):
        works.append(Work(SYS_A + f" question {k}", 210, 8 + (k == 2)))
        works.append(Work(SYS_B + f" question {k}", 210, 8 + (k != 1)))
        works.append(Work(f"write a long story {k}", 8, 300))
    p = plan(works, "blend", min_shared=32)
    group_a = {i for i in range(len(works)) if works[i].key.startswith("A")}
    group_b = {i for i in range(len(works)) if works[i].key.startswith("B")}
    in_groups = [("A" if i in group_a else "B") for i in p.order if i in group_a | group_b]
    assert in_groups in (["A"] * 4 + ["B"] * 4, ["B"] * 4 + ["A"] * 4)
    lead_a = next(i for i in p.order if i in group_a)
    lead_b = next(i for i in p.order if i in group_b)
    assert works[lead_a].output_tokens == 8 and works[lead_b].output_tokens == 8
    assert lead_b == 4   # the B member with 8 output tokens (k = 1); the others have 9
    assert p.leader_of == {**{i: lead_a for i in group_a - {lead_a}}, **{i: lead_b for i in group_b - {lead_b}}}
    stories = [i for i in p.order if i % 3 == 2]
    assert p.order[0] in stories   # and the decodes are spread through, not left to the end
    assert p.order.index(stories[-1]) < len(works) - 1


def test_a_shared_prefix_is_paid_once_between_the_requests_that_share_it():
    # the same lengths with and without a shared prefix: sharing leaves each request less prefill
    # for the same KV reads, so the shared ones are the memory side and the first pick is one of them
    shared = [Work(SYS_A + f"{k}", 201, 8) for k in range(4)]
    alone = [Work(f"{k}" + SYS_A, 201, 8) for k in range(4)]
    p = plan(alone + shared, "blend")
    assert p.order[0] in range(4, 8)
    assert [i in range(4, 8) for i in p.order[:2]] == [True, False]   # then the other side
    assert p.leaders() == {p.order[0]} and len(p.leader_of) == 3


works_strategy = st.lists(
    st.tuples(st.sampled_from(["", SYS_A, SYS_B, SYS_A + "tail"]), st.text("abc", max_size=6),
              st.integers(1, 400), st.integers(1, 300)),
    max_size=40)


@settings(max_examples=150, deadline=None)
@given(works_strategy)
def test_blend_plans_every_request_exactly_once_and_the_same_way_every_time(rows):
    works = [Work(prefix + tail, p, d) for prefix, tail, p, d in rows]
    p = plan(works, "blend")
    assert sorted(p.order) == list(range(len(works)))
    assert plan(list(works), "blend") == p
    for member, leader in p.leader_of.items():   # a leader never waits, and comes before its group
        assert leader not in p.leader_of
        assert p.order.index(leader) < p.order.index(member)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=30))
def test_the_sorted_tree_keeps_every_prefix_group_contiguous(rows):
    """The dual scan's input: a group's requests are next to each other whatever their lengths, so
    each end of the scan walks through a group without leaving it."""
    works = [Work(tuple([g] * 64 + [j]), 65 + tail, out) for j, (g, tail, out) in enumerate(rows)]
    root, comp, mem = sorted_tree(works)
    leaves = root.items()
    assert sorted(leaves) == list(range(len(works)))
    runs = [rows[i][0] for k, i in enumerate(leaves) if k == 0 or rows[leaves[k - 1]][0] != rows[i][0]]
    assert len(runs) == len(set(runs))
    assert len(comp) == len(mem) == len(works) and all(c > 0 and m > 0 for c, m in zip(comp, mem))


def test_without_a_prefix_cache_a_shared_prompt_is_paid_by_every_request_and_nobody_waits():
    # a group of long shared prompts is compute-heavy when each request prefills it in full: it
    # blends with the long decodes from the start instead of waiting at the end of the order
    group = [Work(SYS_A * 2 + f"{k}", 401, 8) for k in range(6)]
    stories = [Work(f"story {k}", 10, 200) for k in range(6)]
    cached = plan(group + stories, "blend", prefix_cache=True)
    uncached = plan(group + stories, "blend", prefix_cache=False)
    assert uncached.leader_of == {} and len(cached.leader_of) == 5
    assert sorted(uncached.order) == list(range(12))
    assert set(uncached.order[:4]) & set(range(6)) and set(uncached.order[:4]) & set(range(6, 12))
