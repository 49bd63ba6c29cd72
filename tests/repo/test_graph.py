from ckptstore.repo.graph import render, topo_order


def test_fork_is_drawn_with_two_lanes_joining():
    parents = {"a": [], "b": ["a"], "c": ["b"], "d": ["c"], "x": ["b"], "y": ["x"]}
    times = {"a": 1, "b": 2, "c": 3, "d": 4, "x": 5, "y": 6}
    order = topo_order(["d", "y"], parents, times.__getitem__)
    assert order.index("b") > max(order.index("c"), order.index("x"))
    lines = render(order, parents, lambda c: c)
    assert lines == ["* y", "* x", "| * d", "| * c", "|/", "* b", "* a"]

