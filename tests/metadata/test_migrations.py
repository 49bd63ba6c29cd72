from sqlalchemy import inspect

from ckptstore import Repository
from ckptstore.metadata import current_revision, make_engine, upgrade
from ckptstore.repo.config import RepoConfig


def test_repository_made_by_an_older_schema_opens_and_upgrades(tmp_path):
    (tmp_path / ".ckpt").mkdir()
    RepoConfig().save(tmp_path / ".ckpt" / "config.toml")
    engine = make_engine(f"sqlite:///{tmp_path / '.ckpt' / 'ckpt.db'}")
    upgrade(engine, "0001")
    assert current_revision(engine) == "0001"
    assert not inspect(engine).has_table("known_files")
    engine.dispose()
    with Repository.open(tmp_path) as repo:
        assert current_revision(repo.engine) == "0005"
        assert inspect(repo.engine).has_table("known_files")
        assert "checksum" in {c["name"] for c in inspect(repo.engine).get_columns("tensor_chunks")}


def test_database_uses_wal(tmp_path):
    with Repository.init(tmp_path) as repo, repo.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
