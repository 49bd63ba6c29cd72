from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.metadata.liveness import reached
from ckptstore.repo.graph import render, topo_order


def test_fork_is_drawn_with_two_lanes_joining():
    parents = {"a": [], "b": ["a"], "c": ["b"], "d": ["c"], "x": ["b"], "y": ["x"]}
    times = {"a": 1, "b": 2, "c": 3, "d": 4, "x": 5, "y": 6}
    order = topo_order(["d", "y"], parents, times.__getitem__)
    assert order.index("b") > max(order.index("c"), order.index("x"))
    lines = render(order, parents, lambda c: c)
    assert lines == ["* y", "* x", "| * d", "| * c", "|/", "* b", "* a"]



def test_a_lane_joins_its_own_past_the_lanes_between_one_column_a_row():
    """x (from b) drew one `/` into z's lane (from a), reading as a child of a."""
    parents = {"a": [], "b": ["a"], "x": ["b"], "z": ["a"], "c": ["b"]}
    times = {"a": 1, "b": 2, "x": 3, "z": 4, "c": 5}
    lines = render(topo_order(["c", "z", "x"], parents, times.__getitem__), parents, lambda c: c)
    assert lines == ["* c", "| * z", "| | * x", "| |/", "|/|", "* | b", "|/", "* a"]
    parents = {"a": [], "b": ["a"], "x": ["b"], "y": ["b"], "z": ["a"], "w": ["z"], "c": ["b"]}
    times = {"a": 1, "b": 2, "z": 3, "x": 4, "y": 5, "w": 6, "c": 7}
    lines = render(topo_order(["c", "w", "y", "x"], parents, times.__getitem__), parents, lambda c: c)
    # two lanes join b past a's; the one right of the first moves left with it
    assert lines == ["* c", "| * w", "| | * y", "| | | * x", "| * | | z", "| |/ /", "|/| |", "| |/", "|/|", "* | b",
                     "|/", "* a"]


def _sorted_each_time(tips, parents, time_of):
    """topo_order as it was written first (the ready list sorted again before each pop): the reference order."""
    reachable = reached(tips, parents)
    children = {cid: 0 for cid in reachable}
    for cid in reachable:
        for parent in parents.get(cid, []):
            children[parent] += 1
    ready, order = [cid for cid, count in children.items() if count == 0], []
    while ready:
        ready.sort(key=lambda c: (time_of(c), c))
        cid = ready.pop()
        order.append(cid)
        for parent in parents.get(cid, []):
            children[parent] -= 1
            if children[parent] == 0:
                ready.append(parent)
    return order


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(0, 39), max_size=2)), min_size=1, max_size=40))
def test_the_heap_gives_the_order_sorting_gave_on_any_history(rows):
    """topo_order sorted its ready list before every pop: quadratic in the tips, 3 s for `log --all` with 5,000
    branches (auditor). The heap must keep the order, ties between equal times included."""
    names = [f"c{i:02d}" for i in range(len(rows))]
    parents = {names[i]: sorted({names[p] for p in ps if p < i}) for i, (_, ps) in enumerate(rows)}
    times = {names[i]: float(t) for i, (t, _) in enumerate(rows)}
    tips = [name for name in names if not any(name in ps for ps in parents.values())]
    assert topo_order(tips, parents, times.__getitem__) == _sorted_each_time(tips, parents, times.__getitem__)


def test_many_tips_are_ordered_newest_first():
    """5,000 one-commit branches: the order is still newest first (its cost is measured in the note, not here)."""
    parents = {"root": [], **{f"b{i:05d}": ["root"] for i in range(5000)}}
    order = topo_order([f"b{i:05d}" for i in range(5000)], parents, lambda c: 0.0 if c == "root" else float(c[1:]))
    assert order[0] == "b04999" and order[-2:] == ["b00000", "root"]
