"""The `ckpt` launcher (launch.py): what it sets up before the CLI, or a daemon, loads numpy."""

import subprocess
import sys

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

