"""The wheel carries every subpackage and the migrations, so a plain install can open repositories."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_every_package_and_migration(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("ckptstore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "ckptstore").rglob("__init__.py")}
    assert packages and all(f"{package}/__init__.py" in names for package in packages), packages
    migrations = {f"ckptstore/migrations/versions/{p.name}" for p in (ROOT / "migrations" / "versions").glob("0*.py")}
    assert migrations and migrations <= names
    assert {"ckptstore/migrations/env.py", "ckptstore/migrations/script.py.mako"} <= names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "ckpt = ckptstore.launch:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
