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
