"""The plane cache: residuals coded against the planes the last commit kept are the same bytes as
residuals coded against planes replayed from the store, and the cache holds no more than it may."""

from __future__ import annotations

import numpy as np

from ckptstore import Repository
from ckptstore.hashing import TensorId
from ckptstore.repo.planecache import PlaneCache, cache_of, set_cache


def _states(steps: int) -> list[dict[str, np.ndarray]]:
    """A small training-like sequence: fp32 and bf16-sized tensors drifting a little each step."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal(100_000).astype(np.float32)
    moment = np.abs(rng.standard_normal(5_000)).astype(np.float32) * 1e-4
    half = rng.standard_normal(40_000).astype(np.float16)
    states = []
    for _ in range(steps):
        weight = weight + rng.standard_normal(weight.size).astype(np.float32) * 1e-4
        moment = moment * 0.99 + np.abs(rng.standard_normal(moment.size)).astype(np.float32) * 1e-6
        half = (half + rng.standard_normal(half.size).astype(np.float16) * np.float16(1e-3)).astype(np.float16)
        states.append({"w": weight.copy(), "v": moment.copy(), "h": half.copy(), "step": len(states)})
    return states


def _store(root, states, cached: bool) -> tuple[list[str], list[dict]]:
    """Commit `states` in order; returns the sorted object ids and every checked-out state."""
    with Repository.init(root) as repo:
        if not cached:
            set_cache(repo, PlaneCache(budget_bytes=0))  # keeps nothing: every base is replayed
        cids = [repo.commit(state, message=str(i)) for i, state in enumerate(states)]
        ids = sorted(repo.store.iter_ids())
        restored = [repo.checkout(cid) for cid in cids]
    return ids, restored


def test_cached_planes_give_the_same_objects_as_replayed_ones(tmp_path):
    states = _states(5)  # the fourth and fifth code against the second's planes (2 levels here)
    cached_ids, restored = _store(tmp_path / "cached", states, cached=True)
    replayed_ids, _ = _store(tmp_path / "replayed", states, cached=False)
    assert cached_ids == replayed_ids
    for state, back in zip(states, restored):
        for key in ("w", "v", "h"):
            assert np.asarray(back[key]).tobytes() == state[key].tobytes()


def test_commits_take_the_planes_the_last_commit_kept(tmp_path):
    states = _states(4)
    with Repository.init(tmp_path / "repo") as repo:
        taken = []
        cache = cache_of(repo)
        original = cache.take

        def counting(*args):
            planes = original(*args)
            taken.append(planes is not None)
            return planes

        cache.take = counting
        for state in states:
            repo.commit(state)
        # every residual chunk found its base in memory, the fourth commit's too: at the chain's
        # limit (2 levels here) the third commit kept its base's planes, which the fourth codes against
        assert taken and all(taken)
        assert cache.held_bytes > 0  # and the fourth kept them again for the fifth


def test_the_cache_keeps_within_its_budget_and_hands_each_entry_out_once():
    cache = PlaneCache(budget_bytes=3000)
    planes = [np.full((4, 250), i, dtype=np.uint8) for i in range(4)]  # 1000 bytes each
    for i, p in enumerate(planes):
        cache.put(TensorId(f"t{i}"), 0, p)
    assert cache.held_bytes == 3000
    assert cache.take(TensorId("t0"), 0, 4, 1000) is None  # the oldest went first
    got = cache.take(TensorId("t1"), 0, 4, 1000)
    assert got is not None and all(np.array_equal(g, planes[1][j]) for j, g in enumerate(got))
    assert cache.take(TensorId("t1"), 0, 4, 1000) is None  # handed out once
    assert cache.take(TensorId("t2"), 0, 2, 1000) is None  # another layout: not these planes
    cache.next_commit()
    cache.next_commit()  # nothing took t3 during a whole commit: dropped
    assert cache.held_bytes == 0 and cache.take(TensorId("t3"), 0, 4, 1000) is None
