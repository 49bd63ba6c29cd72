"""ASCII history graph for `ckpt log --graph`, in the spirit of git's."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence


def topo_order(tips: Sequence[str], parents: Mapping[str, list[str]], time_of: Callable[[str], float]) -> list[str]:
    """Commits reachable from `tips`, children before parents, newest first among the ready ones."""
    reachable, stack = set(), list(tips)
    while stack:
        cid = stack.pop()
        if cid not in reachable:
            reachable.add(cid)
            stack.extend(parents.get(cid, []))
    children = {cid: 0 for cid in reachable}
    for cid in reachable:
        for parent in parents.get(cid, []):
            children[parent] += 1
    ready = [cid for cid, count in children.items() if count == 0]
    order = []
    while ready:
        ready.sort(key=lambda c: (time_of(c), c))
        cid = ready.pop()
        order.append(cid)
        for parent in parents.get(cid, []):
            children[parent] -= 1
            if children[parent] == 0:
                ready.append(parent)
    return order


def render(order: Sequence[str], parents: Mapping[str, list[str]], describe: Callable[[str], str]) -> list[str]:
    """One line per commit (`*` in its lane), plus `/` lines where lanes join."""
    lanes: list[str] = []
    lines: list[str] = []
    for cid in order:
        if cid not in lanes:
            lanes.append(cid)
        col = lanes.index(cid)
        duplicates = [i for i, lane in enumerate(lanes) if lane == cid and i != col]
        if duplicates:
            first = duplicates[0]
            marks = ["|"] * len(lanes)
            lines.append(" ".join(marks[:first]) + "/" + " /" * (len(lanes) - first - 1))
            lanes = [lane for i, lane in enumerate(lanes) if i not in duplicates]
        marks = ["*" if i == col else "|" for i in range(len(lanes))]
        lines.append(f"{' '.join(marks)} {describe(cid)}")
        commit_parents = parents.get(cid, [])
        if commit_parents:
            lanes[col] = commit_parents[0]
            for extra in commit_parents[1:]:
                if extra not in lanes:
                    lanes.insert(col + 1, extra)
        else:
            lanes.pop(col)
    return lines
