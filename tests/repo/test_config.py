"""config.toml as a user edits it (repo/config.py): every mistake one error naming the key, before anything runs."""

import json
import os

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import CkptError
from ckptstore.repo.config import RepoConfig, user_cache
from tests.conftest import ckpt_here


def _with(tmp_path, text: str | bytes):
    Repository.init(tmp_path).close()
    config = tmp_path / ".ckpt" / "config.toml"
    config.write_bytes(text if isinstance(text, bytes) else config.read_bytes() + text.encode())
    return config


@pytest.mark.parametrize("added, said", [
    ('\n[core2]\nx = 1\n', r"unknown key 'core2' \(a typo, or a newer ckptstore's\?\); the keys are core, encoding"),
    ('\n[remotes.origin]\nurl = "../o"\nlazy = "false"\n', r"\[remotes.origin\] needs .* lazy true or false"),
    ('\n[remotes.origin]\nurl = 5\n', r"\[remotes.origin\] needs url and metadata_url strings"),
    ('\n[remotes.r]\nurl = "../o"\nmetdata_url = "sqlite:///x.db"\n',
     r"\[remotes.r\] unknown key 'metdata_url' \(a typo, or a newer ckptstore's\?\); the keys are url, metadata_url"),
    ('\n[remotes.r]\nmetadata_url = ""\n', r"\[remotes.r\] needs url \(the remote's folder or URL\)$"),
    (b'remotes = 5\n', r"\[remotes\] must hold \[remotes.NAME\] tables, not 5$"),
    (b'encoding = "x"\n', r"\[encoding\] must be a table of settings, not 'x'$"),
    ('\n[remotes]\nr = "../o"\n', r"\[remotes.r\] must be a table of settings \(url = ...\), not '../o'$"),
])
def test_unknown_sections_and_values_of_the_wrong_type_are_refused(tmp_path, added, said):
    """A misspelt section was ignored, and lazy = "false" (a string) read as true (auditor). A misspelt key in
    [remotes.NAME] was ignored (push went without the database named), and a remote with no url or `remotes = 5`
    spoke Python's KeyError and AttributeError, `encoding = "x"` its TypeError (damaged-metadata audit, helper 314)."""
    with pytest.raises(CkptError, match=f"cannot read .*config.toml: .*{said}"):
        RepoConfig.load(_with(tmp_path, added))


@pytest.mark.parametrize("old, new, said", [
    ('threads = 0', 'threads = 0\nloosy = "balanced"', r"\[core\] unknown key 'loosy'.*the keys are objects_url"),
    ('lossy = ""', 'lossy = "Balanced"', r"\[core\] lossy must be one of none, optimizer, balanced"),
    ('zstd_level = 1', 'zstd_level = 1\nbogus = 2', r"\[encoding\] unknown key 'bogus'.*max_chain, chunk_bytes"),
    ('max_chain = "auto"', 'max_chain = "²"', r"max_chain must be 'auto' or a count of levels"),
])
def test_misspelt_keys_and_levels_are_refused_naming_them(tmp_path, old, new, said):
    """A misspelt [core] key was ignored (a commit silently lossless); `lossy = "Balanced"` failed only at each
    commit; [encoding] spoke Python's TypeError; max_chain = "²" was an unexpected ValueError (auditor)."""
    Repository.init(tmp_path).close()
    config = tmp_path / ".ckpt" / "config.toml"
    assert old in config.read_text()
    config.write_text(config.read_text().replace(old, new))
    with pytest.raises(CkptError, match=f"cannot read .*config.toml: .*{said}"):
        RepoConfig.load(config)


def test_a_config_that_is_not_utf8_is_one_error(tmp_path):
    config = _with(tmp_path, b"[core]\nlossy = \"\xff\"\n")
    failed = ckpt_here(tmp_path, "log")
    assert failed.returncode == 1 and failed.stderr.startswith(f"error: cannot read {config}")
    assert "unexpected" not in failed.stderr



@pytest.mark.parametrize("how", ["objects", "metadata", "clone", "remote"])
def test_a_location_whose_name_is_not_utf8_is_refused_before_any_config_holds_it(tmp_path, how):
    """Written as an escape TOML refuses: init said it made the repository that no command could then open, a clone
    left a half-made one, and `remote add` ended in an unexpected error (auditor helper 279, high)."""
    odd = os.fsdecode(b"odd\xfd")
    ckpt_here(tmp_path, "init", "src").check_returncode()
    ckpt_here(tmp_path, "init", odd).check_returncode()  # a folder's own name need not be UTF-8: no config holds it
    args = {"objects": ["init", "--objects", odd + "-objects", "r"],
            "metadata": ["init", "--metadata", f"sqlite:///{tmp_path}/{odd}/x.db", "r"],
            "clone": ["clone", odd, "r"], "remote": ["--repo", "src", "remote", "add", "o", str(tmp_path / odd)]}[how]
    before = (tmp_path / "src" / ".ckpt" / "config.toml").read_bytes()
    result = ckpt_here(tmp_path, *args)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "location" in result.stderr and "odd\\xfd" in result.stderr
    assert "holds bytes that are not UTF-8" in result.stderr
    assert "nothing was changed" in result.stderr
    assert not (tmp_path / "r").exists()
    assert (tmp_path / "src" / ".ckpt" / "config.toml").read_bytes() == before
    assert ckpt_here(tmp_path, "--repo", "src", "log").returncode == 0

def test_init_takes_lossy_none_as_commit_does(tmp_path):
    assert ckpt_here(tmp_path, "init", "--lossy", "none").returncode == 0
    assert RepoConfig.load(tmp_path / ".ckpt" / "config.toml").lossy == "none"


@pytest.mark.parametrize("value", ["", "relative/cache"])
def test_an_empty_or_relative_xdg_cache_home_counts_as_unset(monkeypatch, tmp_path, value):
    """An empty XDG_CACHE_HOME put ./ckptstore/chaincost.json into whatever folder a command ran in (auditor)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", value)
    assert user_cache() == tmp_path / ".cache" / "ckptstore"


def test_chain_costs_that_are_not_positive_numbers_are_refused(monkeypatch):
    from ckptstore.repo import chaincost

    monkeypatch.setenv(chaincost.ENV, json.dumps({"4": [1.0, 1.0, 1.0, 1.0]}).replace("1.0, 1.0, 1.0, 1.0",
                                                                                     "NaN, NaN, NaN, 1"))
    with pytest.raises(CkptError, match="every cost must be a positive number"):
        chaincost._pinned()


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_an_objects_url_naming_no_folder_is_said_so_and_nothing_is_made(tmp_path, kind):
    """A mistyped objects_url was made anew, empty, even by `ckpt log`; the next commit then called the
    repository damaged. One naming a file was "unexpected FileExistsError" (auditor)."""
    with Repository.init(tmp_path / "r", objects_url=str(tmp_path / "objects")) as repo:
        repo.commit({"w": torch.ones(3)})
    wrong = tmp_path / "typo" / "objects"
    if kind == "file":
        wrong = tmp_path / "a-file"
        wrong.write_text("x")
    config = tmp_path / "r" / ".ckpt" / "config.toml"
    config.write_text(config.read_text().replace(str(tmp_path / "objects"), str(wrong)))
    failed = ckpt_here(tmp_path / "r", "log")
    said = "which does not exist (a typo, or a disk not mounted?)" if kind == "missing" else "which is a file"
    assert failed.returncode == 1 and said in failed.stderr and "unexpected" not in failed.stderr
    assert not (tmp_path / "typo").exists()


def test_remote_edits_keep_the_comments_and_order_a_user_gave_the_config(tmp_path):
    """`ckpt remote add/set-url/remove` wrote config.toml afresh from what it parsed: every comment was lost."""
    for name in ("o1", "o2"):
        Repository.init(tmp_path / name).close()
    config = _with(tmp_path / "repo", "\n# the lab's settings: ask Ana before changing\n")
    config.write_text("# written by hand\n" + config.read_text().replace("threads = 0", "threads = 2  # a shared box"))
    for args in (("add", "origin", str(tmp_path / "o1")), ("add", "backup", str(tmp_path / "o2")),
                 ("set-url", "origin", str(tmp_path / "o2")), ("remove", "backup")):
        assert ckpt_here(tmp_path / "repo", "remote", *args).returncode == 0, args
    text = config.read_text()
    assert text.startswith("# written by hand\n[core]\n") and "threads = 2  # a shared box\n" in text
    assert "# the lab's settings: ask Ana before changing\n" in text and "backup" not in text
    saved = RepoConfig.load(config)
    assert saved.threads == 2 and {n: r.url for n, r in saved.remotes.items()} == {"origin": str(tmp_path / "o2")}


@pytest.mark.parametrize("rule", ["keep_last", "keep_every"])
def test_a_negative_retention_count_is_refused_and_no_commit_is_pruned(tmp_path, rule):
    """keep_last = -1 is no count: read as one, `[retention]` pruned after the next commit (mutation audit)."""
    from ckptstore.repo.config import RetentionPolicy

    with pytest.raises(CkptError, match=rf"^retention {rule} must be a count \(0 or more\), not -1$"):
        RetentionPolicy(**{rule: -1})
    with Repository.init(tmp_path) as repo:
        cids = [repo.commit({"w": torch.full((100,), float(step))}, step=step) for step in range(4)]
    config = tmp_path / ".ckpt" / "config.toml"
    config.write_text(config.read_text() + f"\n[retention]\n{rule} = -1\nkeep_tagged = true\n")
    with pytest.raises(CkptError, match=rf"cannot read {config}: retention {rule} must be a count \(0 or more\), "
                                        r"not -1"):
        RepoConfig.load(config)
    failed = ckpt_here(tmp_path, "log")
    assert failed.returncode == 1 and f"retention {rule} must be a count (0 or more), not -1" in failed.stderr
    config.write_text(config.read_text().replace(f"{rule} = -1", f"{rule} = 0"))
    with Repository.open(tmp_path) as repo:
        assert [(c.id, c.pruned) for c in repo.log()] == [(cid, False) for cid in reversed(cids)]


def _add_remotes(root: str, hub: str, names: list[str], start) -> None:
    """A forked process's `ckpt remote add NAME hub` for each of `names`, begun when `start` is set."""
    start.wait(30)
    for name in names:
        if ckpt_here(root, "remote", "add", name, hub).returncode != 0:
            os._exit(1)
    os._exit(0)


def test_remote_adds_from_processes_at_once_each_keep_their_remote(tmp_path):
    """Two `remote add`s at once each saved the config they had read: one remote was lost (edit_config's lock)."""
    import multiprocessing

    Repository.init(tmp_path / "repo").close()
    Repository.init(tmp_path / "repo" / "hub").close()
    context = multiprocessing.get_context("fork")
    start = context.Event()
    names = [[f"p{p}-r{r}" for r in range(12)] for p in range(4)]
    adders = [context.Process(target=_add_remotes, args=(str(tmp_path / "repo"), "hub", batch, start))
              for batch in names]
    for adder in adders:
        adder.start()
    start.set()
    try:
        for adder in adders:
            adder.join(60)
    finally:
        for adder in adders:
            adder.kill()  # one stuck would outlive the test
    assert [adder.exitcode for adder in adders] == [0] * len(adders)
    saved = RepoConfig.load(tmp_path / "repo" / ".ckpt" / "config.toml")
    assert sorted(saved.remotes) == sorted(name for batch in names for name in batch)
    listed = ckpt_here(tmp_path / "repo", "remote", "list")
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == 48
