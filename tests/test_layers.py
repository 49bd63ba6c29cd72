"""The import graph follows shared/DESIGN.md's package map: imports point down the layers only.

Every import in every module counts, at module level or inside a function (a lazy import is
still a dependency). Heavy third-party packages stay in the modules that own them.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ckptstore"

# layer -> module name prefixes (relative to ckptstore)
LAYERS = {
    "base": ("errors", "faults", "hashing", "holders", "paths", "records", "signals", "threadlocal", "warn"),
    "storage": ("objectstore",),
    "coding": ("codecs",),
    "state": ("state", "formats"),
    "metadata": ("metadata",),
    "policy": ("policy",),
    "replay": ("replay", "replay_torch"),
    "repo": ("repo",),
    "integrations": ("api", "integrations", "dcp"),
    "cli": ("cli", "__main__", "daemon", "daemon_server", "launch"),
    "testing": ("testing",),
}
BELOW = {
    "base": {"base"},
    "storage": {"base", "storage"},
    "coding": {"base", "coding"},
    "state": {"base", "state"},
    "metadata": {"base", "metadata"},
    "policy": {"base", "coding", "state", "policy"},
    "replay": {"base", "coding", "storage", "replay"},
    "repo": {"base", "storage", "coding", "state", "metadata", "policy", "replay", "repo"},
    "integrations": {"base", "storage", "coding", "state", "metadata", "policy", "replay", "repo", "integrations"},
    "cli": {"base", "repo", "integrations", "cli"},
    "testing": {"base", "storage", "coding", "state", "metadata", "policy", "replay", "repo", "testing"},
}
# third-party package -> the only modules (prefixes) that may import it
OWNED = {
    "sqlalchemy": ("metadata",),
    "alembic": ("metadata",),
    "click": ("cli",),
    "torch": ("state", "formats", "replay_torch", "policy.sensitivity", "integrations", "dcp"),
    "boto3": ("objectstore.s3",),
    "obstore": ("objectstore.s3",),
    "psycopg": ("metadata.postgres", "testing.postgres_server"),
    "pytorch_lightning": ("integrations.lightning",),
    "lightning_fabric": ("integrations.lightning",),
    "lightning": ("integrations.lightning",),
}


_ROOT_NAMES = __import__("ckptstore")._WHERE  # the names `ckptstore` re-exports, by the module each comes from


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def _imports(name: str, path: Path) -> set[str]:
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join((["ckptstore"] + package.split("."))[: len(package.split(".")) + 2 - node.level])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            found.add(module)
            if module == "ckptstore":  # a submodule (formats), or a name the root loads lazily (Repository)
                found |= {_ROOT_NAMES.get(alias.name, f"ckptstore.{alias.name}") for alias in node.names}
            elif node.level and not node.module:  # `from . import refs` names a submodule
                found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def _layer(module: str) -> str | None:
    """The layer of `module` (relative to ckptstore), or None for the package root."""
    for layer, prefixes in LAYERS.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    return None


def _owned_by(module: str, owners: tuple[str, ...]) -> bool:
    return any(module == o or module.startswith(o + ".") for o in owners)


def _violations() -> list[str]:
    problems = []
    for name, path in _modules():
        layer = _layer(name)
        if layer is None:
            continue
        for imported in _imports(name, path):
            top = imported.split(".")[0]
            if top == "ckptstore":
                target = _layer(imported.removeprefix("ckptstore").lstrip("."))
                if target is not None and target not in BELOW[layer]:
                    problems.append(f"{name} ({layer}) imports {imported} ({target})")
            elif top in OWNED and not _owned_by(name, OWNED[top]):
                problems.append(f"{name} imports {top}, which only {', '.join(OWNED[top])} may")
    return problems


def test_every_module_has_a_layer():
    unplaced = [name for name, _ in _modules() if name and _layer(name) is None]
    assert unplaced == []


def test_imports_point_down_the_layers_and_heavy_packages_stay_home():
    assert _violations() == []


@pytest.mark.parametrize("module", ["cli", *(f"cli.{p.stem}" for p in sorted((PACKAGE / "cli").glob("[!_]*.py"))),
                                    "daemon", "daemon_server", "launch"])
def test_the_cli_uses_only_the_repository_layers_public_names(module):
    path = PACKAGE / module.replace(".", "/")
    imported = _imports(module, path / "__init__.py" if path.is_dir() else path.with_suffix(".py"))
    ours = {m for m in imported if m.startswith("ckptstore") and not m.startswith("ckptstore.cli.")}
    assert ours <= {"ckptstore.errors", "ckptstore.paths", "ckptstore.repo", "ckptstore.cli", "ckptstore.daemon"}


def test_the_checker_sees_a_violation(tmp_path):
    """The checker itself: an import against the map is reported."""
    fake = tmp_path / "deadzone.py"
    fake.write_text("import sqlalchemy\nfrom ckptstore.repo import Repository\n")
    assert _imports("codecs.deadzone", fake) == {"sqlalchemy", "ckptstore.repo"}
    assert _layer("repo") not in BELOW["coding"] and not _owned_by("codecs.deadzone", OWNED["sqlalchemy"])
    # the package root's lazy names and a bare relative import name their modules (code reviewer)
    fake.write_text("from ckptstore import Repository\nfrom .. import cli\n")
    assert {"ckptstore.repo", "ckptstore.cli"} <= _imports("codecs.deadzone", fake)


@pytest.mark.parametrize("module, absent", [
    ("ckptstore.codecs", ("sqlalchemy", "torch", "ckptstore.repo", "ckptstore.metadata", "click")),
    ("ckptstore", ("sqlalchemy", "torch", "numpy", "ckptstore.repo", "psycopg")),
    ("ckptstore.cli", ("sqlalchemy", "alembic", "torch", "numpy", "zstandard", "psycopg")),
    ("ckptstore.repo.repository", ("sqlalchemy", "torch", "numpy", "psycopg")),
    ("ckptstore.repo.history", ("torch", "numpy", "psycopg")),  # what `ckpt log` runs
])
def test_importing_a_module_loads_only_what_it_needs(module, absent):
    code = f"import sys, {module}; print(' '.join(sorted(m for m in sys.modules)))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                 .stdout.split())
    assert module in loaded
    assert sorted(m for m in absent if m in loaded) == []


def test_a_sqlite_repository_never_loads_psycopg(tmp_path):
    code = (f"import sys; from ckptstore import Repository; r = Repository.init({str(tmp_path)!r}); r.log(); "
            f"r.close(); r = Repository.open({str(tmp_path)!r}); r.branches(); print('psycopg' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False"]


def test_ckpt_status_loads_neither_numpy_nor_torch(tmp_path):
    """`ckpt status` hashes the files HEAD came from: it needs the manifest and blake3, not the parsers."""
    from ckptstore import Repository

    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (folder / "trainer_state.json").write_text('{"global_step": 1}')
    with Repository.init(tmp_path) as repo:
        repo.commit(folder, message="one")
    (folder / "trainer_state.json").write_text('{"global_step": 2}')
    code = ("import sys\nfrom ckptstore.cli.entry import main\ntry:\n    main(['status'])\n"
            "except SystemExit:\n    pass\n"
            "print(' '.join(m for m in ('numpy', 'torch', 'sqlalchemy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    *report, loaded = result.stdout.splitlines()
    assert [line.split() for line in report[1:]] == [["unchanged:", "checkpoint-1/model.safetensors"],
                                                      ["modified:", "checkpoint-1/trainer_state.json"]]
    assert loaded.split() == []

