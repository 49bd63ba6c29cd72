"""One-line-per-commit views (log --graph, stats) of multi-line messages, and stats of a commit storing nothing."""

import torch

from ckptstore import Repository
from tests.conftest import ckpt_here


def test_graph_and_stats_show_a_messages_first_line_and_nothing_new_has_no_ratio(tmp_path):
    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.ones(10_000)}, message="lr halved\n* not a commit\r\nthird line")
        repo.commit({"w": torch.zeros(10_000)}, message="second")
        repo.commit({"w": torch.ones(10_000)}, message="back to the first state")  # every object stored already
    graph = ckpt_here(tmp_path, "log", "--graph")
    assert graph.returncode == 0, graph.stderr
    lines = graph.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("* ") for line in lines), lines
    assert lines[2].endswith(" lr halved")
    stats = ckpt_here(tmp_path, "stats")
    rows = stats.stdout.splitlines()[1:4]
    assert [row.split()[-1] for row in rows] == ["halved", "second", "state"], stats.stdout
    assert "  -  back to the first state" in rows[2] and " 0 B " in rows[2], rows[2]
    as_json = __import__("json").loads(ckpt_here(tmp_path, "stats", "--json").stdout)
    assert as_json["commits"][2]["ratio"] is None and as_json["commits"][0]["ratio"] > 0


def test_stats_lists_commits_by_history_not_by_their_clocks(tmp_path, monkeypatch):
    """A commit made on a machine whose clock was behind was listed before its parent (text/time auditor)."""
    with Repository.init(tmp_path) as repo:
        first = repo.commit({"w": torch.ones(8)}, message="first")
        monkeypatch.setattr("ckptstore.repo.commit.time.time", lambda: 1e8)  # 1973
        second = repo.commit({"w": torch.zeros(8)}, message="second")
        assert [row["id"] for row in repo.stats()["commits"]] == [first, second]
