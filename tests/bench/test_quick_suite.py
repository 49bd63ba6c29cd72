"""`python -m bench --quick` end to end on tiny runs: every figure in its tables present and finite."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ckpt_env

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"^[+-]?\d+(\.\d+)?(x|%)?$")


def test_quick_suite_writes_complete_tables_and_plots(tmp_path):
    env = ckpt_env(HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (tmp_path / "benchmarks.md").read_text()
    data = json.loads((tmp_path / "benchmarks.json").read_text())
    runs = {r["run"] for r in data["results"]}
    assert runs == {"scratch-fp32", "scratch-bf16", "minilm-finetune", "minilm-frozen", "sgd-momentum", "trainer-gpt2"}
    rows = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    methods = {row.split("|")[1].strip() for row in rows}
    assert {"torch.save", "zstd-3 of each file", "ZipNN per tensor", "safetensors", "ckptstore lossless",
            "ExCP (re-implementation)"} <= methods
    assert len(rows) == len(runs) * len(methods)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")[1:]]
        for cell in cells:
            for part in cell.split(" / "):
                assert part == "bit-exact" or NUMBER.match(part), (row, part)
                if part != "bit-exact":
                    assert math.isfinite(float(part.rstrip("x%"))), row
    for result_ in data["results"]:
        for method in result_["methods"].values():
            for key in ("stored", "commit_s", "checkout_s"):
                assert all(math.isfinite(v) and v >= 0 for v in method[key])
            if method["lossy"]:
                assert all(math.isfinite(v) for v in method["eval"]) and math.isfinite(method["resume"])
        for name, method in result_["methods"].items():  # ckptstore's sizes count its database, as baselines'
            assert (method["metadata_bytes"] > 0) is name.startswith("ckptstore"), name  # count their headers
    for image in ("stored-per-commit.png", "ratio-vs-loss.png"):
        assert (tmp_path / "img" / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
