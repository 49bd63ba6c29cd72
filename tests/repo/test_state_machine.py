"""A hypothesis state machine that drives a real repository and compares it with a plain model.

Each example inits a repository in a fresh temporary folder and runs random commits (in-memory
states and torch.save files, to HEAD or to a branch), branches, tags, checkouts (in memory, to
another path, and moving HEAD), deletions of branches, gc and gc --prune. The model keeps every
commit's expected state and parent, the branches, the tags and HEAD. After every step the refs
must match; after every step that adds or removes objects every commit still known must restore
bit-exact; fsck must pass every few steps and at the end.

Bounded by the hypothesis profiles of tests/conftest.py; the long run:
    CKPT_HYPOTHESIS_PROFILE=long python -m pytest -q tests/repo/test_state_machine.py
The machine runs twice: on SQLite metadata (TestRepositoryMachine) and on a fresh PostgreSQL
database per example (test_the_machine_on_postgresql).
"""

from __future__ import annotations

import hashlib
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import event
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from ckptstore import Repository
from ckptstore.errors import (
    CkptError,
    DirtyWorktreeError,
    NothingToCommitError,
    RefExistsError,
    RefNotFoundError,
)
from ckptstore.repo import fsck, gc
from tests.conftest import assert_same, machine_settings

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]
TENSOR_NAMES = ["embed", "norm.weight", "fc.bias", "exp_avg", "exp_avg_sq"]
TIED = "tied"  # a second name for the first tensor, as tied embeddings are
REF_NAMES = ["main", "dev", "exp/a", "v1.0"]  # branches and tags share one namespace
FILE_PATHS = ["checkpoint.pt", "run/step.pt"]
FSCK_EVERY = 5
SHAPES = st.one_of(st.just(()), st.lists(st.integers(0, 5), min_size=1, max_size=3
                                         ).map(tuple), st.just((48, 33)))


# ---------------------------------------------------------------------- states
def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int, how: str) -> torch.Tensor:
    """A tensor of `shape`: random bit patterns (NaN payloads, subnormals), smooth values or zeros."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if how == "zeros" or n == 0:
        return torch.zeros(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n).astype(bool)).reshape(shape)
    if how == "smooth":
        return torch.from_numpy(rng.standard_normal(n) * 10).to(dtype).reshape(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(rng.integers(0, 256, n * itemsize, dtype=np.uint8)).view(dtype).reshape(shape)


def tweaked(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """A copy of `tensor` with a few raw bytes changed (a training step's worth of change, or none if empty)."""
    copy = tensor.clone().contiguous()
    flat = copy.reshape(-1)
    if flat.numel() == 0:
        return copy
    rng = np.random.default_rng(seed)
    where = torch.from_numpy(rng.integers(0, flat.numel(), 1 + flat.numel() // 10))
    if copy.dtype == torch.bool:
        flat[where] = ~flat[where]
    else:
        flat.view(torch.uint8)[where * copy.element_size()] ^= 0x21
    return copy


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype, shape = draw(st.sampled_from(DTYPES)), draw(SHAPES)
    how = draw(st.sampled_from(["bits", "bits", "smooth", "zeros"]))
    seed = draw(st.integers(0, 2**32 - 1))
    if len(shape) == 2 and draw(st.booleans()):  # a transposed view: not contiguous
        return random_tensor(dtype, shape[::-1], seed, how).t()
    return random_tensor(dtype, shape, seed, how)


def draw_state(data: st.DataObject, base: dict | None) -> dict:
    """A new state: tensors of `base` kept (the same objects), tweaked, replaced or dropped, new ones added."""
    model: dict[str, torch.Tensor] = {}
    for name, tensor in (base["model"] if base else {}).items():
        if name == TIED:
            continue
        action = data.draw(st.sampled_from(["keep", "keep", "tweak", "new", "drop"]), label=f"{name}")
        if action == "keep":
            model[name] = tensor
        elif action == "tweak":
            model[name] = tweaked(tensor, data.draw(st.integers(0, 2**32 - 1)))
        elif action == "new":
            model[name] = data.draw(tensors())
    for name in data.draw(st.lists(st.sampled_from(TENSOR_NAMES), max_size=3, unique=True), label="added"):
        model.setdefault(name, data.draw(tensors()))
    if model and data.draw(st.booleans(), label="copy"):  # equal content at two paths, not one tensor
        source = data.draw(st.sampled_from(sorted(model)))
        model[data.draw(st.sampled_from(TENSOR_NAMES), label="copy to")] = model[source].clone()
    if model and data.draw(st.booleans(), label="tie"):
        model[TIED] = next(iter(model.values()))
    step = data.draw(st.sampled_from([base["step"] if base else 0, 0, 1]), label="step")
    return {"model": model, "step": step}


def alias_groups(state: dict) -> set[frozenset[str]]:
    """Names whose tensors are one tensor (same storage, offset, shape, strides), as flatten sees them."""
    groups: dict[tuple, set[str]] = {}
    for name, t in state["model"].items():
        if t.numel():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            groups.setdefault(key, set()).add(name)
    return {frozenset(g) for g in groups.values()}


def same_state(a: dict, b: dict) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return alias_groups(a) == alias_groups(b)


def assert_restored(expected: dict, got: Any, where: str) -> None:
    """Bit-exact values and structure, and one tensor where the state had one (and only there)."""
    assert_same(expected, got, where)
    assert alias_groups(expected) == alias_groups(got), f"{where}: tensors shared differently"


def file_digest(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes()).hexdigest()


@dataclass
class Expected:
    """What the model knows of one commit."""

    state: dict
    parent: str | None
    source: str | None  # the work-tree path of a commit made from a file, None for an in-memory state


# ---------------------------------------------------------------------- the machine
class RepositoryMachine(RuleBasedStateMachine):
    """A real repository and the model it must agree with."""

    def __init__(self, metadata_url: str = "") -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="ckpt-repo-machine-"))
        self.repo = Repository.init(self.folder / "work", metadata_url=metadata_url)
        self.commits: dict[str, Expected] = {}
        self.branches: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.head_branch: str | None = "main"  # None when detached
        self.detached: str | None = None
        # File contents the repository has recorded (committed or written by checkout), by digest:
        # the commits that recorded them. A file is safe to overwrite while one of them exists.
        self.known: dict[str, set[str]] = {}
        self.store_changed = True
        self.steps = 0

    # ------------------------------------------------------------ model helpers
    def head_commit(self) -> str | None:
        return self.branches.get(self.head_branch) if self.head_branch else self.detached

    def reachable(self) -> set[str]:
        stack = [*self.branches.values(), *self.tags.values(), *([self.detached] if self.detached else [])]
        seen: set[str] = set()
        while stack:
            cid = stack.pop()
            if cid not in seen:
                seen.add(cid)
                stack += [self.commits[cid].parent] if self.commits[cid].parent else []
        return seen

    def ref_specs(self) -> list[tuple[str, str]]:
        """(ref expression, the commit it names): names, HEAD, full ids, prefixes and `~1`."""
        named = [*self.branches.items(), *self.tags.items()]
        named += [("HEAD", self.head_commit())] if self.head_commit() else []
        specs = named + [(f"{name}~1", self.commits[cid].parent) for name, cid in named if self.commits[cid].parent]
        for cid in self.commits:  # in the order made: ids change from run to run, draws must not
            specs += [(cid, cid), (cid[:10], cid)]
        return specs

    def target_of(self, branch: str | None) -> tuple[str | None, str | None]:
        """(branch a commit advances, or None for a detached HEAD; its parent), as Repository.commit documents."""
        if branch is None:
            if self.head_branch is None:
                return None, self.detached
            branch = self.head_branch
        if branch in self.branches:
            return branch, self.branches[branch]
        return branch, self.head_commit() if branch != self.head_branch else None

    def record(self, cid: str, expected: Expected, branch: str | None) -> None:
        assert cid not in self.commits, "a new commit got an existing id"
        self.commits[cid] = expected
        if branch is None:
            self.detached = cid
        else:
            self.branches[branch] = cid
        if expected.source:
            self.remember(self.repo.root / expected.source, cid)
        self.store_changed = True

    def remember(self, path: Path, cid: str) -> None:
        digest = file_digest(path)
        self.known.setdefault(digest, set()).add(cid)

    def is_saved(self, path: Path) -> bool:
        """Whether checkout may overwrite `path`: its content is that of a commit still in the repository."""
        return bool(self.known.get(file_digest(path)))

    def write_file(self, state: dict, relative: str) -> Path:
        path = self.repo.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        return path

    # ------------------------------------------------------------ rules: commits
    @rule(data=st.data(), as_file=st.booleans())
    def commit_to_head(self, data: st.DataObject, as_file: bool) -> None:
        self.commit(data, as_file, None)

    @rule(data=st.data(), as_file=st.booleans(), branch=st.sampled_from(REF_NAMES))
    def commit_to_branch(self, data: st.DataObject, as_file: bool, branch: str) -> None:
        """To an existing branch, a new one (parent: HEAD's commit), HEAD's unborn one, or a tag (refused)."""
        self.commit(data, as_file, branch)

    def commit(self, data: st.DataObject, as_file: bool, branch: str | None) -> None:
        """Commit a state derived from any known one; allow_empty only where it equals the parent."""
        base = data.draw(st.sampled_from([None, *self.commits]), label="base")
        state = draw_state(data, self.commits[base].state if base else None)
        source = data.draw(st.sampled_from(FILE_PATHS), label="path") if as_file else None
        what = self.write_file(state, source) if source else state
        if branch in self.tags:
            with pytest.raises(CkptError, match="is a tag"):
                self.repo.commit(what, branch=branch)
            return
        target, parent = self.target_of(branch)
        unchanged = (parent is not None and (self.commits[parent].source is None) == (source is None)
                     and same_state(state, self.commits[parent].state))
        event(f"commit: {'file' if source else 'state'}{', equal to its parent' if unchanged else ''}")
        cid = self.repo.commit(what, message="machine", step=state["step"], branch=branch, allow_empty=unchanged)
        self.record(cid, Expected(state, parent, source), target)

    @precondition(lambda self: self.head_commit() is not None)
    @rule(data=st.data(), allow_empty=st.booleans())
    def commit_unchanged(self, data: st.DataObject, allow_empty: bool) -> None:
        """HEAD's checkpoint again (fresh objects, same content) is refused, unless allow_empty."""
        parent = self.head_commit()
        expected = self.commits[parent]
        copies = {id(t): t.clone() for t in expected.state["model"].values()}  # keeps a tie a tie
        state = {"model": {n: copies[id(t)] for n, t in expected.state["model"].items()},
                 "step": expected.state["step"]}
        what = self.write_file(state, expected.source) if expected.source else state
        with pytest.raises(NothingToCommitError):
            self.repo.commit(what)
        event(f"commit: unchanged {'file' if expected.source else 'state'} refused")
        if allow_empty:
            cid = self.repo.commit(what, allow_empty=True)
            self.record(cid, Expected(state, parent, expected.source), self.head_branch)

    @rule(data=st.data(), relative=st.sampled_from(FILE_PATHS))
    def training_writes_file(self, data: st.DataObject, relative: str) -> None:
        """Training saves a checkpoint that is not committed (yet): checkout must not overwrite it."""
        base = data.draw(st.sampled_from([None, *self.commits]), label="base")
        self.write_file(draw_state(data, self.commits[base].state if base else None), relative)

    # ------------------------------------------------------------ rules: refs
    @precondition(lambda self: self.commits)
    @rule(data=st.data(), name=st.sampled_from(REF_NAMES), tag=st.booleans())
    def create_ref(self, data: st.DataObject, name: str, tag: bool) -> None:
        spec, cid = data.draw(st.sampled_from(self.ref_specs()), label="start")
        create = self.repo.tag if tag else self.repo.branch
        unborn_head = tag and name == self.head_branch and name not in self.branches
        if name in self.branches or name in self.tags or unborn_head:  # a tag may not take HEAD's unborn branch
            with pytest.raises(RefExistsError):
                create(name, spec)
            return
        assert create(name, spec) == cid
        (self.tags if tag else self.branches)[name] = cid

    @rule(name=st.sampled_from(REF_NAMES))
    def delete_branch(self, name: str) -> None:
        if name in self.tags:  # said to be a tag, with how to delete it
            with pytest.raises(CkptError, match=f"'{name}' is a tag, not a branch"):
                self.repo.delete_branch(name)
        elif name not in self.branches:
            with pytest.raises(RefNotFoundError):
                self.repo.delete_branch(name)
        elif name == self.head_branch:
            with pytest.raises(CkptError, match="HEAD is on it"):
                self.repo.delete_branch(name)
        else:
            assert self.repo.delete_branch(name) == self.branches.pop(name)

    # ------------------------------------------------------------ rules: checkouts
    @precondition(lambda self: self.commits)
    @rule(data=st.data())
    def checkout_in_memory(self, data: st.DataObject) -> None:
        spec, cid = data.draw(st.sampled_from(self.ref_specs()), label="ref")
        assert_restored(self.commits[cid].state, self.repo.checkout(spec), f"checkout {spec}")

    @precondition(lambda self: self.commits)
    @rule(data=st.data())
    def checkout_to_output(self, data: st.DataObject) -> None:
        """`checkout -o`: any commit, file or in-memory, written elsewhere; HEAD stays."""
        spec, cid = data.draw(st.sampled_from(self.ref_specs()), label="ref")
        output = self.folder / "out" / f"{self.steps}.pt"
        output.parent.mkdir(exist_ok=True)  # -o needs an existing folder
        assert self.repo.checkout_to(spec, output=output) == output
        assert_restored(self.commits[cid].state, torch.load(output, weights_only=True), f"checkout {spec} -o")
        self.remember(output, cid)

    @precondition(lambda self: self.commits)
    @rule(data=st.data(), force=st.booleans())
    def checkout_moving_head(self, data: st.DataObject, force: bool) -> None:
        """`checkout REF`: writes the file back where it was committed from and moves HEAD."""
        spec, cid = data.draw(st.sampled_from(self.ref_specs()), label="ref")
        source = self.commits[cid].source
        if source is None:
            with pytest.raises(CkptError, match="in-memory state"):
                self.repo.checkout_to(spec)
            return
        dest = self.repo.root / source
        if dest.exists() and not force and not self.is_saved(dest):
            event("checkout moving HEAD: refused, unsaved file")
            with pytest.raises(DirtyWorktreeError):
                self.repo.checkout_to(spec)
            return
        assert self.repo.checkout_to(spec, force=force) == dest
        # a branch attaches HEAD; HEAD itself keeps it where it is (on its branch, or detached); the rest detach
        branch = self.head_branch if spec == "HEAD" else spec if spec in self.branches else None
        event(f"checkout moving HEAD: {'attached' if branch else 'detached'}")
        assert_restored(self.commits[cid].state, torch.load(dest, weights_only=True), f"checkout {spec}")
        self.remember(dest, cid)
        self.head_branch, self.detached = branch, None if branch else cid

    # ------------------------------------------------------------ rules: maintenance
    @rule()
    def collect_garbage(self) -> None:
        """Plain gc keeps every commit, reachable or not; afterwards no object is unreferenced."""
        gc(self.repo)
        self.after_gc()

    @rule()
    def prune(self) -> None:
        """gc --prune deletes exactly the commits no branch, tag or detached HEAD reaches."""
        doomed = set(self.commits) - self.reachable()
        report = gc(self.repo, prune_unreachable=True)
        assert report.commits_removed == len(doomed)
        event(f"prune: {'some' if doomed else 'no'} commits removed")
        for cid in doomed:
            del self.commits[cid]
            with pytest.raises(RefNotFoundError):
                self.repo.resolve(cid)
        for cids in self.known.values():
            cids -= doomed
        self.after_gc()

    def after_gc(self) -> None:
        report = fsck(self.repo)
        assert report.ok, report
        assert report.unreferenced_objects == 0
        self.store_changed = True

    # ------------------------------------------------------------ invariants
    @invariant()
    def refs_match(self) -> None:
        self.steps += 1
        assert self.repo.branches() == self.branches
        assert self.repo.tags() == self.tags
        assert self.repo.head() == (self.head_branch, self.head_commit())
        assert {c.id for c in self.repo.log(all_refs=True)} == self.reachable()

    @invariant()
    def commits_restore(self) -> None:
        """Every commit the model knows restores bit-exact with its parent, after each step that changed objects."""
        if not self.store_changed:
            return
        self.store_changed = False
        for cid, expected in self.commits.items():
            assert self.repo.commit_info(cid).parents == ([expected.parent] if expected.parent else [])
            assert_restored(expected.state, self.repo.checkout(cid), f"commit {cid[:12]}")

    @invariant()
    def fsck_ok(self) -> None:
        if self.steps % FSCK_EVERY == 0:
            report = fsck(self.repo)
            assert report.ok, report

    def teardown(self) -> None:
        try:
            self.store_changed = True
            self.commits_restore()
            report = fsck(self.repo, full=True)
            assert report.ok and not report.broken_commits, report
        finally:
            self.repo.close()
            shutil.rmtree(self.folder)


def test_checkout_after_prune_trusts_a_file_a_surviving_commit_recorded(repo):
    """Found by the machine: ckpt.pt holds main's content, yet checkout calls it unsaved after a prune."""
    path = repo.root / "ckpt.pt"
    torch.save({"w": torch.arange(6.0)}, path)
    repo.commit(path, branch="side")  # recorded first, under the side commit
    repo.commit({"w": torch.ones(2)}, branch="main")
    kept = repo.commit(path, branch="main")  # the same bytes again, on main
    repo.delete_branch("side")
    assert gc(repo, prune_unreachable=True).commits_removed == 1
    assert repo.checkout_to("main") == path
    assert repo.head() == ("main", kept)


def test_tag_named_like_the_unborn_branch(repo):
    """Found by the machine: on an unborn `main`, tag `main` made HEAD report the tag's commit."""
    first = repo.commit({"w": torch.ones(2)}, branch="dev")
    with pytest.raises(CkptError, match="no commits yet"):
        repo.tag("main", first)
    assert repo.head() == ("main", None)


RepositoryMachine.TestCase.settings = machine_settings(scale=1.0)
TestRepositoryMachine = RepositoryMachine.TestCase


def test_the_machine_on_postgresql(postgres_server):
    """The same machine with the metadata in PostgreSQL: a fresh database per example."""
    from ckptstore.metadata import Database

    made = [postgres_server.new_database()]
    Database(made[0]).close()  # the schema, made once: each example's database is a copy

    def machine() -> RepositoryMachine:
        made.append(postgres_server.new_database(template=made[0]))
        return RepositoryMachine(made[-1])

    try:
        # half the examples: each step costs two to three times SQLite's (a server round trip per statement)
        run_state_machine_as_test(machine, settings=machine_settings(scale=0.5))
    finally:
        for url in made:
            postgres_server.drop_database(url)
