"""One-line-per-commit views (log --graph, stats) of multi-line messages, and stats of a commit storing nothing."""

import json

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import CorruptRecordError, RefNotFoundError
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
    as_json = json.loads(ckpt_here(tmp_path, "stats", "--json").stdout)
    assert as_json["commits"][2]["ratio"] is None and as_json["commits"][0]["ratio"] > 0


def test_stats_lists_commits_by_history_not_by_their_clocks(tmp_path, monkeypatch):
    """A commit made on a machine whose clock was behind was listed before its parent (text/time auditor)."""
    with Repository.init(tmp_path) as repo:
        first = repo.commit({"w": torch.ones(8)}, message="first")
        monkeypatch.setattr("ckptstore.repo.commit.time.time", lambda: 1e8)  # 1973
        second = repo.commit({"w": torch.zeros(8)}, message="second")
        assert [row["id"] for row in repo.stats()["commits"]] == [first, second]


def _forked(repo):
    """main: m1 - m2 - m3; side from m1: s1 - s2. Returns the ids by name."""
    ids = {"m1": repo.commit({"w": torch.full((8,), 1.0)}, message="m1")}
    ids["m2"] = repo.commit({"w": torch.full((8,), 2.0)}, message="m2")
    repo.branch("side", ids["m1"])
    ids["m3"] = repo.commit({"w": torch.full((8,), 3.0)}, message="m3")
    ids["s1"] = repo.commit({"w": torch.full((8,), 4.0)}, message="s1", branch="side")
    ids["s2"] = repo.commit({"w": torch.full((8,), 5.0)}, message="s2", branch="side")
    return ids


def test_log_of_refs_and_of_ranges_lists_what_git_would(tmp_path):
    """`ckpt log main..side` and `ckpt log feature` were refused: log took no revision at all."""
    with Repository.init(tmp_path) as repo:
        ids = _forked(repo)
        names = {cid: name for name, cid in ids.items()}
        listed = lambda *args, **kw: [names[c.id] for c in repo.log(*args, **kw)]
        assert listed() == ["m3", "m2", "m1"]  # HEAD is on main
        assert listed("side") == ["s2", "s1", "m1"]
        assert listed("main..side") == ["s2", "s1"]
        assert listed("side..main") == ["m3", "m2"]
        assert listed("side..") == ["m3", "m2"]  # an empty side is HEAD
        assert listed("..side") == ["s2", "s1"]
        assert sorted(listed("main...side")) == ["m2", "m3", "s1", "s2"]
        assert listed(["side", "main~1"]) == ["s2", "s1", "m2", "m1"]
        assert listed(["main..side", "main~1"]) == ["s2", "s1"]  # what a range hides stays hidden
        assert listed("main", limit=2) == ["m3", "m2"]
        assert listed("side..side") == []
        assert len(repo.log(all_refs=True, limit=0)) == 0 and len(repo.log(all_refs=True)) == 5
        with pytest.raises(RefNotFoundError):
            repo.log("nope..main")


def test_log_cli_takes_revisions_and_a_count_and_graph_lanes_end_where_the_range_does(tmp_path):
    with Repository.init(tmp_path) as repo:
        ids = _forked(repo)
    shown = ckpt_here(tmp_path, "log", "--json", "-n", "1", "main")
    assert shown.returncode == 0, shown.stderr
    assert [c["id"] for c in json.loads(shown.stdout)] == [ids["m3"]]
    graph = ckpt_here(tmp_path, "log", "--graph", "side..main")
    lines = graph.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("* ") for line in lines), lines  # no lane left open to m1
    both = ckpt_here(tmp_path, "log", "--graph", "main...side").stdout.splitlines()
    assert len(both) == 4 and all(line.startswith("* ") for line in both), both  # nor one to the shared m1 (reader 39)
    with Repository.open(tmp_path) as repo:
        assert repo.log_graph(True) == repo.log_graph(all_refs=True)  # all_refs stays the first argument
        assert len(repo.log_graph(ref="side")) == 3
        with pytest.raises(TypeError, match="ref="):  # not every branch's history, silently (reader 40)
            repo.log_graph("side")
    text = ckpt_here(tmp_path, "log", "main...side").stdout
    assert text.count("\ncommit ") + text.startswith("commit ") == 4 and ids["m1"] not in text
    oneline = ckpt_here(tmp_path, "log", "--oneline", "--all").stdout.splitlines()
    with Repository.open(tmp_path) as repo:
        every = repo.log(all_refs=True)
    assert [line.split()[0] for line in oneline] == [c.id[:12] for c in every], oneline  # the log's, a line each
    assert all(line.endswith(f" {c.message}") for line, c in zip(oneline, every)) and "(HEAD -> main)" in oneline[2]
    assert ckpt_here(tmp_path, "log", "--oneline", "--json").returncode == 2
    refused = ckpt_here(tmp_path, "log", "-n", "-1")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr


def test_diff_of_a_range_is_the_diff_of_its_two_ends_and_one_ref_alone_is_refused_clearly(tmp_path):
    with Repository.init(tmp_path) as repo:
        _forked(repo)
        assert repo.diff("main~1..main") == repo.diff("main~1", "main")
        assert repo.diff("side~1..") == repo.diff("side~1", "HEAD")
    alone = ckpt_here(tmp_path, "diff", "main")
    assert alone.returncode == 2 and "give `main B` or `main..B`" in alone.stderr, alone.stderr
    three = ckpt_here(tmp_path, "diff", "main...side")
    assert three.returncode == 1 and "ckpt diff main side" in three.stderr, three.stderr
    assert ckpt_here(tmp_path, "diff", "main~1..main").stdout == ckpt_here(tmp_path, "diff", "main~1", "main").stdout


def test_a_range_whose_hiding_side_runs_through_a_commit_with_no_record_is_refused_not_listed_wrong(tmp_path):
    """`ckpt log main..side` with m2's record gone listed m1 as side's own: the walk of what main hides stopped at
    m2, while `ckpt log main` refused the same history (reader 39); `ckpt log main` now lists m3 and warns."""
    import contextlib
    import sqlite3

    from ckptstore.errors import CorruptRecordError

    with Repository.init(tmp_path) as repo:
        ids = _forked(repo)
    with contextlib.closing(sqlite3.connect(tmp_path / ".ckpt" / "ckpt.db")) as db, db:
        db.execute("DELETE FROM commits WHERE id = ?", (ids["m2"],))
    with Repository.open(tmp_path) as repo:
        for spec in ("main..side", "main...side"):
            with pytest.raises(CorruptRecordError, match=ids["m2"]):
                repo.log(spec)
        # main alone: what is above m2, with a warning that the rest was left out, as `ckpt log main` lists it
        with pytest.warns(RuntimeWarning, match=f"commit {ids['m2']} is damaged: .*the history behind it was left"):
            assert [c.id for c in repo.log("main")] == [ids["m3"]]
        assert [c.id for c in repo.log("side")] == [ids["s2"], ids["s1"], ids["m1"]]  # an undamaged history lists


def _damaged_refs_and_a_commit_row(repo, tmp_path) -> dict[str, str]:
    """A repository whose branch side names no commit, tag v1 a commit with no record, branch other a garbled id and
    branch exp's own commit a row whose metrics do not parse (rows written as another client would), by name."""
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    ids = {"first": repo.commit(tmp_path / "m.pt")}
    for name in ("side", "other", "exp"):
        repo.branch(name)
    repo.tag("v1")
    ids["exp"] = repo.commit({"w": torch.full((2,), 3.0)}, branch="exp", message="on exp")
    ids["second"] = repo.commit({"w": torch.zeros(2)}, message="second")
    with repo.db.write() as tx:
        tx.execute("UPDATE refs SET commit_id = NULL WHERE name = 'side'")
        tx.execute("UPDATE refs SET commit_id = ? WHERE name = 'v1'", ("ab" * 32,))
        tx.execute("UPDATE refs SET commit_id = 'zz!!' WHERE name = 'other'")
        tx.execute("UPDATE commits SET metrics = '{bad' WHERE id = ?", (ids["exp"],))
    return ids


@pytest.mark.both_backends
def test_log_all_and_stats_list_every_readable_commit_past_damaged_refs_and_rows_and_exit_1(repo, tmp_path):
    """One branch naming no commit, or a commit with no record, or one commit row that did not parse made
    `ckpt log --all` and `ckpt stats` one error and nothing listed (a gap left open); `ckpt log`
    of main failed on exp's row, which it does not list (fixer helper 326)."""
    ids = _damaged_refs_and_a_commit_row(repo, tmp_path)
    for verb in (["log", "--all", "--oneline"], ["log", "--all"], ["log", "--all", "--json"], ["stats"]):
        result = ckpt_here(tmp_path, *verb)
        assert result.returncode == 1, (verb, result.stderr)
        assert all(cid[:12] in result.stdout for cid in ids.values()), (verb, result.stdout)
        warnings, last = result.stderr.splitlines()[:-1], result.stderr.splitlines()[-1]
        assert len(warnings) == 4 and all(line.startswith("warning: the metadata of ") for line in warnings), warnings
        said = dict(line.removeprefix("warning: the metadata of ").split(" is damaged: ", 1) for line in warnings)
        assert said["ref side"].startswith("it points at no commit") and "`ckpt branch -d side`" in said["ref side"]
        assert f"commit {'ab' * 32}, which has no record" in said["ref v1"] and "`ckpt tag -d v1`" in said["ref v1"]
        assert "commit zz!!, which has no record" in said["ref other"], said
        assert "its metrics '{bad' do not parse" in said[f"commit {ids['exp']}"], said
        assert last == ("error: 4 damaged records of the metadata (warned of above) were left out or shown in part; "
                        "the rest was listed. Run `ckpt fsck` to list all damage"), last
    main = ckpt_here(tmp_path, "log", "--oneline")
    assert main.returncode == 0 and main.stderr == "", main.stderr
    assert [line[:12] for line in main.stdout.splitlines()] == [ids["second"][:12], ids["first"][:12]]


def _sql(repo, *statements):
    """Damage the metadata as a bad tool or a bad hand would: raw statements, in one transaction."""
    with repo.db.write() as tx:
        for statement in statements:
            tx.execute(statement)


@pytest.mark.both_backends
def test_the_python_listings_go_past_damaged_rows_with_one_warning_as_the_cli_does(repo):
    """One branch naming no commit, a tag naming a lost one, a commit's metrics and HEAD's row damaged:
    `Repository.log(all_refs=True)` and `stats()` raised on the first, where `ckpt log --all`,
    `stats` and `branch` listed the rest (auditor helper 354). Now they return what is sound and warn once."""
    first = repo.commit({"w": torch.zeros(4)}, metrics={"loss": 1.0}, step=1)
    second = repo.commit({"w": torch.ones(4)}, step=2)
    repo.branch("side", first)
    repo.branch("lost", first)
    repo.tag("v1", first)
    _sql(repo, "UPDATE refs SET commit_id = NULL WHERE name = 'lost'",
         f"UPDATE refs SET commit_id = '{'a' * 64}' WHERE name = 'v1'",
         f"UPDATE commits SET metrics = '{{' WHERE id = '{first}'",
         "UPDATE refs SET target = NULL, commit_id = NULL WHERE name = 'HEAD'")
    with pytest.warns(RuntimeWarning) as told:
        assert [c.id for c in repo.log(all_refs=True)] == [second, first]
    assert len(told) == 1, [str(w.message) for w in told]
    said = str(told[0].message)
    for what in ("ref lost is damaged: it points at no commit", f"ref v1 is damaged: it points at commit {'a' * 64}",
                 f"commit {first} is damaged: its metrics '{{' do not parse", "ref HEAD is damaged", "`ckpt fsck`"):
        assert what in said, said
    with pytest.warns(RuntimeWarning, match="ref lost is damaged"):
        assert [row["id"] for row in repo.stats()["commits"]] == [first, second]
    # branches() and tags() give the rows as held: a plugin mends a tag naming a lost commit by its name
    assert repo.tags() == {"v1": "a" * 64}
    with pytest.raises(CorruptRecordError, match="ref HEAD is damaged: it names no branch and no commit"):
        repo.log()  # HEAD's history: nothing sound to list
    with pytest.warns(RuntimeWarning, match="metrics"):
        assert [c.id for c in repo.log("side")] == [first]


def test_a_commit_row_whose_numbers_are_text_is_listed_past_not_an_unexpected_type_error(tmp_path):
    """SQLite keeps text in a number column: stats ended in "unexpected TypeError" (its raw_bytes 'x'), and
    `ckpt log` at its created_at (auditor helper 354). Now the row is damage named, listed without the value."""
    with Repository.init(tmp_path) as repo:
        first = repo.commit({"w": torch.zeros(4)}, step=1)
        second = repo.commit({"w": torch.ones(4)}, step=2)
        _sql(repo, f"UPDATE commits SET raw_bytes = 'x', created_at = 'y' WHERE id = '{first}'")
        with pytest.warns(RuntimeWarning, match=f"commit {first} is damaged: its created_at 'y' is not a number"):
            data = repo.stats()
        assert [row["raw_bytes"] for row in data["commits"]] == [0, 16] and data["raw_bytes"] == 16
    for verb in (["stats"], ["log"]):
        result = ckpt_here(tmp_path, *verb)
        assert result.returncode == 1 and "unexpected" not in result.stderr, (verb, result.stderr)
        assert f"warning: the metadata of commit {first} is damaged: its created_at 'y' is not a number" \
            in result.stderr, (verb, result.stderr)
        assert second[:12] in result.stdout and first[:12] in result.stdout, (verb, result.stdout)
