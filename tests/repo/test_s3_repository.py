"""A repository whose objects live on S3-compatible storage (moto's server on 127.0.0.1): every verb, bit-exact."""

import copy
import json

import obstore
import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import CkptError, CorruptObjectError, RepoExistsError
from ckptstore.objectstore.s3 import S3ObjectStore
from ckptstore.repo import fsck, gc
from tests.conftest import assert_same, ckpt_here


def _state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    small = {f"layer{i}.bias": torch.randn(64 + i, generator=generator) for i in range(20)}
    return {"small": small, "big": torch.randn(1 << 19, generator=generator), "step": seed}


pytestmark = pytest.mark.both_backends  # objects on the bucket, records in SQLite or PostgreSQL


@pytest.fixture
def s3_repo(tmp_path, s3_url, metadata_url):
    with Repository.init(tmp_path / "work", objects_url=s3_url, metadata_url=metadata_url) as repository:
        yield repository


def test_commits_round_trip_through_the_bucket(s3_repo, trainer):
    assert isinstance(s3_repo.store, S3ObjectStore)
    saved = {}
    for round_ in range(3):
        trainer.train(3)
        state = copy.deepcopy(trainer.state())  # the live tensors keep training
        saved[s3_repo.commit(state, message=f"round {round_}", lossy="balanced" if round_ == 2 else None)] = state
    for cid, state in list(saved.items())[:2]:
        assert_same(state, s3_repo.checkout(cid))
    assert not (s3_repo.dir / "objects").exists()
    assert len(list(s3_repo.store.iter_ids())) > 3
    assert fsck(s3_repo).ok
    stats = s3_repo.stats()
    listed = obstore.list(s3_repo.store._client, prefix="repo/objects/").collect()
    assert stats["objects_bytes"] == sum(item["size"] for item in listed) > 0 and len(stats["commits"]) == 3


def test_packs_are_read_by_range_from_the_bucket(s3_repo):
    states = [_state(seed) for seed in range(2)]
    cids = [s3_repo.commit(state) for state in states]  # the second: residuals against packed parents
    for cid, state in zip(cids, states):
        assert_same(state, s3_repo.checkout(cid))


def test_gc_removes_only_what_no_commit_needs(s3_repo):
    kept = s3_repo.commit(_state(0))
    s3_repo.branch("side", kept)
    s3_repo.commit(_state(1), branch="side")
    s3_repo.delete_branch("side")
    stray = s3_repo.store.put(b"an object no commit names")
    before = set(s3_repo.store.iter_ids())
    report = gc(s3_repo, prune_unreachable=True)
    assert report.commits_removed == 1 and not s3_repo.store.has(stray)
    assert report.objects_removed == len(before - set(s3_repo.store.iter_ids())) > 2
    assert_same(_state(0), s3_repo.checkout(kept))
    assert fsck(s3_repo).ok


def test_gc_takes_off_damage_markers_another_process_wrote_for_what_it_deletes(s3_repo, s3_url):
    """gc removed only the markers its own process had listed: another machine's marker of an object gc deleted
    (or an earlier gc had) stayed for ever, and every later commit loaded the records it reused to check them."""
    s3_repo.commit(_state(0))
    on_main = set(s3_repo.store.iter_ids())
    s3_repo.branch("side")
    s3_repo.commit(_state(1), branch="side")
    side_only = sorted(set(s3_repo.store.iter_ids()) - on_main)
    another_machine = S3ObjectStore(s3_url)
    long_gone = "ab" * 32  # an object an earlier gc deleted before this marker's writer learned of it
    for oid in (side_only[0], long_gone):
        another_machine.damage.add(oid)
    assert another_machine.damage.ids() == {side_only[0], long_gone}
    s3_repo.delete_branch("side")
    gc(s3_repo, prune_unreachable=True)
    assert not s3_repo.store.has(side_only[0])
    assert S3ObjectStore(s3_url).damage.ids() == set()


def test_wrong_bytes_from_the_bucket_are_refused_with_the_object_named(s3_repo):
    cid = s3_repo.commit(_state(0))
    manifest = s3_repo.manifest(cid)
    with s3_repo.db.read() as tx:
        from ckptstore.metadata import tensors as tensor_rows

        records = tensor_rows.load_records(tx, [manifest.entries["big"].tensor], with_bases=False)
    victim = next(iter(records.values())).chunks[0].object_id
    good = s3_repo.store.get(victim)
    obstore.put(s3_repo.store._client, s3_repo.store.key(victim), good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CorruptObjectError, match=victim):
        s3_repo.checkout(cid)
    report = fsck(s3_repo)
    assert victim in report.damaged_objects and cid in report.broken_commits


def test_a_clone_refusing_wrong_bytes_from_a_bucket_names_the_bucket_not_a_local_cache(s3_url, postgres_url,
                                                                                        tmp_path):
    """The message named the per-user cache folder a bucket remote is opened in, as if it were the repository."""
    from ckptstore.repo import remote

    with Repository.init(tmp_path / "work", objects_url=s3_url, metadata_url=postgres_url) as shared:
        shared.commit(_state(0))
        victim = next(iter(shared.store.iter_ids()))
        good = shared.store.get(victim)
        obstore.put(shared.store._client, shared.store.key(victim), good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CorruptObjectError, match=f"the repository at {s3_url} \\(metadata .*\\) holds a damaged "
                                                 f"object \\({victim}"):
        remote.clone(s3_url, tmp_path / "copy", metadata_url=postgres_url)


def test_cli_init_on_a_bucket_then_commit_and_checkout(tmp_path, s3_url):
    torch.save(_state(3), tmp_path / "ckpt.pt")

    made = ckpt_here(tmp_path, "init", "--objects", s3_url)
    assert made.returncode == 0 and s3_url in made.stdout, made.stderr
    assert ckpt_here(tmp_path, "commit", "ckpt.pt", "-m", "on s3").returncode == 0
    assert ckpt_here(tmp_path, "checkout", "HEAD", "-o", "back.pt").returncode == 0
    assert_same(torch.load(tmp_path / "ckpt.pt", weights_only=True), torch.load(tmp_path / "back.pt",
                                                                                 weights_only=True))

    # A teammate's init over the same prefix without its metadata would call every object garbage
    # (their first gc deleted the team's): refused, with nothing left behind, the bucket untouched.
    other = tmp_path / "other"
    other.mkdir()
    refused = ckpt_here(other, "init", "--objects", s3_url)
    assert refused.returncode != 0 and "already holds objects that no commit" in refused.stderr
    assert "Traceback" not in refused.stderr and not (other / ".ckpt").exists()
    assert ckpt_here(tmp_path, "fsck").returncode == 0


def test_joining_with_a_bucket_that_does_not_exist_says_so(tmp_path, s3_url, metadata_url):
    with Repository.init(tmp_path / "a", objects_url=s3_url, metadata_url=metadata_url) as repo:
        repo.commit(_state(0))
    bucket, _, prefix = s3_url.removeprefix("s3://").partition("/")
    with pytest.raises(CkptError, match="the bucket does not exist"):  # not "holds none of the objects"
        Repository.init(tmp_path / "b", objects_url=f"s3://{bucket}-typo/{prefix}", metadata_url=metadata_url)


def test_a_bucket_gone_is_named_as_such_on_upload(tmp_path, s3_server, metadata_url):
    """A PUT into a bucket that no longer exists used to read as 'object ... is missing'."""
    import urllib.request

    bucket = s3_server.new_bucket()
    with Repository.init(tmp_path, objects_url=f"s3://{bucket}/repo", metadata_url=metadata_url) as repo:
        from ckptstore.objectstore.fallback import held_here

        obstore.delete(held_here(repo.store)._client, "repo/owner.json")  # S3 deletes an empty bucket only
        urllib.request.urlopen(urllib.request.Request(f"{s3_server.endpoint}/{bucket}", method="DELETE"), timeout=30)
        with pytest.raises(CkptError, match="the bucket does not exist") as raised:
            repo.commit(_state(0))
        # its objects went with it: not "nothing was lost ... run the command again" (shared-repository auditor)
        assert "restore it from a backup" in str(raised.value) and "Nothing was lost" not in str(raised.value)


def test_a_push_of_a_damaged_local_object_is_refused_though_the_bucket_has_something_under_its_key(
        tmp_path, s3_server, postgres_url):
    """Where push took a damaged copy here for "held there", an object whose key the bucket answered for (with other
    bytes) was skipped and the push recorded it; no test held the check (mutation audit)."""
    import urllib.request

    from ckptstore.repo import remote

    bucket = s3_server.new_bucket()
    with Repository.init(tmp_path / "work") as work:
        work.commit(_state(0))
        objects = sorted((tmp_path / "work" / ".ckpt" / "objects").glob("??/*"), key=lambda p: p.stat().st_size)
        damaged = objects[-1]
        remote.add(work, "origin", f"s3://{bucket}/repo", metadata_url=postgres_url)
        key = remote.remote_store(work.config.remotes["origin"]).key(damaged.parent.name + damaged.name)
        urllib.request.urlopen(urllib.request.Request(f"{s3_server.endpoint}/{bucket}/{key}", data=b"other bytes",
                                                      method="PUT"), timeout=30)
        damaged.chmod(0o644)
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
        with pytest.raises(CkptError, match="holds a damaged object"):
            remote.push(work, "origin")


def test_gc_leaves_keys_under_objects_that_are_no_object_ids(s3_repo):
    """gc took every key under PREFIX/objects/ for an object: a note or a copy made there by hand was deleted."""
    kept = s3_repo.commit(_state(0))
    client, prefix = s3_repo.store._client, s3_repo.store._objects
    foreign = {f"{prefix}README.txt": b"team notes: do not delete", f"{prefix}ab/backup-of-pack.bin": b"a copy"}
    for key, data in foreign.items():
        obstore.put(client, key, data)
    report = gc(s3_repo)
    assert (report.objects_removed, report.bytes_removed) == (0, 0)
    for key, data in foreign.items():
        assert bytes(obstore.get(client, key).bytes()) == data
    with s3_repo.db.read() as tx:  # the store lists the objects the records name, not the foreign keys
        assert set(s3_repo.store.iter_ids()) == set(tx.column("SELECT id FROM objects"))
    assert_same(_state(0), s3_repo.checkout(kept))


def _two_repositories_sharing_a_base(tmp_path, s3_server, postgres_server):
    """Repositories A and B on their own prefixes and databases, both holding one base checkpoint (a pretrained
    model's weights: the same objects), B a fine-tune of it besides."""
    bucket, base = s3_server.new_bucket(), _state(0)
    made = {}
    for name in ("a", "b"):
        url, database = f"s3://{bucket}/{name}", postgres_server.new_database()
        with Repository.init(tmp_path / name, objects_url=url, metadata_url=database) as repo:
            repo.commit(base)
            if name == "b":
                repo.commit(_state(1))
        made[name] = (url, database)
    return made


def test_metadata_joined_with_another_repositorys_prefix_is_refused_though_they_share_objects(
        tmp_path, s3_server, postgres_server):
    """The join looked for a sample of the metadata's objects in the prefix: A's base model was there in B's
    prefix too, so A's metadata joined B's prefix, and gc there deleted B's fine-tune (auditor)."""
    made = _two_repositories_sharing_a_base(tmp_path, s3_server, postgres_server)
    with pytest.raises(RepoExistsError, match=r"s3://.*/b belongs to another repository: its owner.json names"):
        Repository.init(tmp_path / "y", objects_url=made["b"][0], metadata_url=made["a"][1])
    assert not (tmp_path / "y" / ".ckpt").exists()
    with Repository.open(tmp_path / "b") as b:
        assert fsck(b, full=True).ok and gc(b).objects_removed == 0
        assert_same(b.checkout("HEAD"), _state(1))
    with Repository.init(tmp_path / "x", objects_url=made["a"][0], metadata_url=made["a"][1]) as joined:
        assert_same(joined.checkout("HEAD"), _state(0))  # its own prefix: joined as before


def test_gc_in_a_prefix_that_names_another_repository_deletes_nothing(tmp_path, s3_server, postgres_server):
    """A config edited to name another repository's prefix: gc would call that one's objects garbage."""
    made = _two_repositories_sharing_a_base(tmp_path, s3_server, postgres_server)
    config = tmp_path / "a" / ".ckpt" / "config.toml"
    config.write_text(config.read_text().replace(made["a"][0], made["b"][0]))
    with Repository.open(tmp_path / "a") as a, pytest.raises(RepoExistsError, match="belongs to another repository"):
        gc(a)
    with Repository.open(tmp_path / "b") as b:
        assert fsck(b, full=True).ok


def test_an_init_over_a_prefix_another_repository_owns_is_refused_though_it_holds_no_objects_yet(
        tmp_path, s3_url):
    """B's init took over the prefix A had just been made on (before A's first commit), and B's gc deleted A's
    objects after A committed there (review)."""
    Repository.init(tmp_path / "a", objects_url=s3_url).close()
    with pytest.raises(RepoExistsError, match="belongs to another repository"):
        Repository.init(tmp_path / "b", objects_url=s3_url)
    with Repository.open(tmp_path / "a") as a:
        a.commit(_state(0))
        assert_same(a.checkout("HEAD"), _state(0))
        assert gc(a).objects_removed == 0


def test_a_prefix_made_before_owner_records_is_claimed_by_its_owners_next_commit(tmp_path, s3_server,
                                                                                  postgres_server):
    """Only a join or a gc claimed an unclaimed prefix: its owner committing on did not, and the first wrong join
    took it (review)."""
    import obstore

    from ckptstore.objectstore.fallback import held_here

    made = _two_repositories_sharing_a_base(tmp_path, s3_server, postgres_server)
    with Repository.open(tmp_path / "b") as b:
        obstore.delete(held_here(b.store)._client, "b/owner.json")  # as a prefix made before 0011 is
    with Repository.open(tmp_path / "b") as b:  # a new process: its first write claims the prefix
        b.commit(_state(2))
    with pytest.raises(RepoExistsError, match="belongs to another repository"):
        Repository.init(tmp_path / "y", objects_url=made["b"][0], metadata_url=made["a"][1])


def test_a_prefix_made_before_owner_records_is_claimed_by_its_own_metadata(tmp_path, s3_url, postgres_url):
    from ckptstore.metadata.identity import repository_id
    from ckptstore.objectstore.fallback import held_here

    with Repository.init(tmp_path / "a", objects_url=s3_url, metadata_url=postgres_url) as repo:
        cid = repo.commit(_state(0))
        store = held_here(repo.store)
        obstore.delete(store._client, "repo/owner.json")  # as a prefix made before 0011 is
        assert store.owner_record() is None
        with repo.db.read() as tx:
            mine = repository_id(tx)
    with Repository.init(tmp_path / "b", objects_url=s3_url, metadata_url=postgres_url) as joined:
        assert joined.resolve("main") == cid and held_here(joined.store).owner_record()["repository"] == mine
        assert gc(joined).objects_removed == 0


def test_an_init_at_the_same_path_elsewhere_cannot_take_over_a_prefix_and_a_bound_process_rechecks_at_gc(
        tmp_path, s3_url):
    """An init over a prefix whose owner.json named the same metadata text (one folder path in two containers)
    overwrote the claim, taken for a killed init of this folder; the owner's running process, bound already,
    wrote on and the new repository's gc deleted what it wrote (review, high)."""
    from ckptstore.objectstore.fallback import held_here

    Repository.init(tmp_path / "proj", objects_url=s3_url).close()
    (tmp_path / "proj").rename(tmp_path / "machine-x")  # machine X's repository; machine Y's init is at proj
    with Repository.open(tmp_path / "machine-x") as x:
        gc(x)  # a long-lived process of X: bound to the prefix
        claim = held_here(x.store).owner_record()
        with pytest.raises(RepoExistsError, match="belongs to another repository"):
            Repository.init(tmp_path / "proj", objects_url=s3_url)
        assert not (tmp_path / "proj" / ".ckpt").exists() and held_here(x.store).owner_record() == claim
        cid = x.commit(_state(0))
        assert gc(x).objects_removed == 0
        assert_same(x.checkout(cid), _state(0))
        another = json.dumps({**claim, "repository": "0" * 32}).encode()
        obstore.put(held_here(x.store)._client, "repo/owner.json", another)
        with pytest.raises(RepoExistsError, match="belongs to another repository"):
            gc(x)  # bound once, but a gc reads the claim again before it deletes anything


def test_a_copy_of_a_repository_is_refused_its_prefix_so_its_gc_deletes_nothing_of_the_original(tmp_path, s3_url):
    """`cp -a` of a repository with SQLite metadata copies its id: the copy's gc deleted the objects the original
    committed after the copy (review, high). owner.json names the .ckpt folder's inode too."""
    import shutil

    with Repository.init(tmp_path / "a", objects_url=s3_url) as a:
        a.commit(_state(0))
    shutil.copytree(tmp_path / "a", tmp_path / "copy", symlinks=True)
    with Repository.open(tmp_path / "a") as a:
        cid = a.commit(_state(1))
    with Repository.open(tmp_path / "copy") as copy_, pytest.raises(
            RepoExistsError, match=r"is a copy of it or was moved: .* nothing was changed. `ckpt clone` makes a copy"):
        gc(copy_)
    with Repository.open(tmp_path / "copy") as copy_, pytest.raises(RepoExistsError, match="is a copy of it"):
        copy_.commit(_state(2))
    with Repository.open(tmp_path / "a") as a:
        assert fsck(a, full=True).ok and gc(a).objects_removed == 0
        assert_same(a.checkout(cid), _state(1))


def test_a_damaged_owner_record_is_said_to_be_damaged_not_anothers(tmp_path, s3_url):
    from ckptstore.objectstore.fallback import held_here

    with Repository.init(tmp_path / "a", objects_url=s3_url) as a:
        store = held_here(a.store)
        text = json.dumps(store.owner_record())
        obstore.put(store._client, "repo/owner.json", text[:-5].encode())
    with Repository.open(tmp_path / "a") as a, pytest.raises(
            RepoExistsError, match=r"owner.json, which names the repository this prefix belongs to, is damaged .*: "
                                   r"nothing was changed. If the prefix is this repository's .* delete s3://"):
        a.commit(_state(0))
    obstore.delete(store._client, "repo/owner.json")
    with Repository.open(tmp_path / "a") as a:
        cid = a.commit(_state(0))
        assert held_here(a.store).owner_record()["repository"] == json.loads(text)["repository"]
        assert_same(a.checkout(cid), _state(0))


def test_an_init_refused_a_claimed_prefix_leaves_no_schema_in_its_new_database(tmp_path, s3_server, postgres_url):
    """The schema was made before the claim refused the init: the next init with that database said it joined a
    teammate's repository, its own failed init's leftover (review)."""
    bucket = s3_server.new_bucket()
    Repository.init(tmp_path / "a", objects_url=f"s3://{bucket}/a").close()
    with pytest.raises(RepoExistsError, match="belongs to another repository"):
        Repository.init(tmp_path / "y", objects_url=f"s3://{bucket}/a", metadata_url=postgres_url)
    with Repository.init(tmp_path / "y", objects_url=f"s3://{bucket}/y", metadata_url=postgres_url) as y:
        assert not y.joined and y.log() == []


def test_the_refusal_of_a_claimed_prefix_never_shows_the_metadata_password(tmp_path, s3_url, postgres_server):
    """The init's refusal printed the raw --metadata URL, password and all (review helper 289)."""
    from ckptstore.testing.postgres_server import PASSWORD, PASSWORD_USER

    Repository.init(tmp_path / "a", objects_url=s3_url).close()
    name = postgres_server.new_database().rsplit("/", 1)[1]
    with pytest.raises(RepoExistsError, match="belongs to another repository: .* nothing was made") as info:
        Repository.init(tmp_path / "y", objects_url=s3_url,
                        metadata_url=postgres_server.url(name, user=PASSWORD_USER, password=PASSWORD))
    assert PASSWORD not in str(info.value) and not (tmp_path / "y" / ".ckpt").exists()
