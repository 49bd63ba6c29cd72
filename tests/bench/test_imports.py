"""Every benchmark module imports: a name it takes from ckptstore that moved broke it unseen until it ran."""

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"))
def test_the_benchmark_module_imports(name):
    importlib.import_module(f"bench.{name}")
