"""The `ckpt` launcher (launch.py): what it sets up before the CLI, or a daemon, loads numpy."""

import resource
import subprocess
import sys

import torch

from tests.conftest import ckpt_env


def _env_as_users_have_it() -> dict[str, str]:
    """This checkout's environment without the thread counts the suite pins (OpenBLAS reads OMP_NUM_THREADS too)."""
    env = ckpt_env()
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        env.pop(name, None)
    return env


def test_numpy_under_the_ckpt_command_runs_one_blas_thread():
    """ckptstore threads its own work; OpenBLAS threads only cost memory and could not start under a limit."""
    script = """if True:
        import sys
        from ckptstore import launch
        try:
            launch._launch(["--help"])
        except SystemExit:
            pass
        import numpy, threadpoolctl
        print([pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool["internal_api"] == "openblas"])
    """
    result = subprocess.run([sys.executable, "-c", script], env=_env_as_users_have_it(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[1]"


def test_a_commit_under_a_memory_limit_says_so_or_succeeds_never_interrupted(tmp_path):
    """Under RLIMIT_AS ~140 MiB numpy's OpenBLAS could not start its threads and raised SIGINT itself: `ckpt commit`
    said "error: interrupted" with exit 130, blaming a Ctrl-C nobody pressed (auditor 383)."""
    torch.save({"w": torch.randn(100_000), "b": torch.randn(1000)}, tmp_path / "s.pt")
    subprocess.run([sys.executable, "-m", "ckptstore", "init"], cwd=tmp_path, env=ckpt_env(), check=True,
                   capture_output=True, timeout=120)
    for mib in (135, 140, 145):
        def limit(mib=mib):
            resource.setrlimit(resource.RLIMIT_AS, (mib << 20, mib << 20))

        result = subprocess.run([sys.executable, "-m", "ckptstore", "commit", "s.pt", "--branch", f"b{mib}"],
                                cwd=tmp_path, env=_env_as_users_have_it(), capture_output=True, text=True,
                                timeout=120, preexec_fn=limit)
        assert result.returncode in (0, 1), (mib, result.returncode, result.stderr)
        assert "interrupted" not in result.stderr, (mib, result.stderr)
        assert result.returncode == 0 or result.stderr.splitlines()[-1].startswith("error: "), (mib, result.stderr)
