"""Fixtures of the metadata tests."""

import pytest

from ckptstore.metadata import Database


@pytest.fixture
def db(tmp_path, metadata_url):
    """A database at head on the backend the test runs on (SQLite in tmp_path unless `metadata_url` names one)."""
    database = Database(metadata_url or f"sqlite:///{tmp_path / 'ckpt.db'}")
    yield database
    database.close()
