"""``make demo``: what it runs, and that it needs no Redis (nor the root or sudo its install takes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support import needs

ROOT = Path(__file__).resolve().parents[2]


def test_make_demo_passes_demo_args_and_skips_the_redis_setup() -> None:
    p = subprocess.run(["make", "-n", "-C", str(ROOT), "demo", "DEMO_ARGS=--records 20000 --rate 500"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "KIW_SETUP_REDIS=0" in p.stdout
    assert "-m worker demo --records 20000 --rate 500" in p.stdout


def _setup_env_venv(cache: Path) -> Path:
    """The venv setup_env.sh picks for this interpreter and the default extras, computed by the script's own
    ``extras=`` and ``key=``/``venv=`` lines (not a copy of them that could drift: a copy that drifted pointed
    at a venv that does not exist, and the test skipped)."""
    script = (ROOT / "worker" / "local" / "setup_env.sh").read_text()
    extras = re.search(r'^extras="\$\{KIW_EXTRAS:-[a-z,]+\}"\n', script, re.M)
    key = re.search(r'^key="\$\(.*?^venv="\$cache/venv-py\$pyver-\$key"\n', script, re.M | re.S)
    assert extras and key, ("setup_env.sh no longer sets extras= / key= ... venv= as this test "
                            "reads them: update it")
    env = {k: v for k, v in os.environ.items() if k != "KIW_EXTRAS"}
    p = subprocess.run(["bash", "-c", 'set -euo pipefail; root=$1; cache=$2; '
                                      f'pyver=$3\n{extras[0]}{key[0]}echo "$venv"',
                        "_", str(ROOT), str(cache), f"{sys.version_info[0]}.{sys.version_info[1]}"],
                       capture_output=True, text=True, env=env, timeout=30)
    assert p.returncode == 0 and p.stdout.strip(), p.stderr
    return Path(p.stdout.strip())


def test_setup_env_with_kiw_setup_redis_0_needs_no_redis_server(tmp_path: Path) -> None:
    # The venv the script would pick must exist already (a test must not install PyTorch). In CI make test's
    # setup has just built it, so a missing one fails there.
    cache = Path(os.environ.get("KIW_CACHE", Path.home() / ".cache" / "kafka-inference-worker"))
    venv = _setup_env_venv(cache)
    if not (venv / ".complete").exists():
        needs.missing(f"no ready virtual environment at {venv} (make setup builds it)")
    # A PATH without redis-server, apt-get or sudo: installing it could only fail.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            if name not in ("redis-server", "apt-get", "sudo") and not (bin_dir / name).exists():
                (bin_dir / name).symlink_to(os.path.join(d, name))
    env = {**{k: v for k, v in os.environ.items() if k != "KIW_EXTRAS"}, "PATH": str(bin_dir),
           "PYTHON": sys.executable, "KIW_CACHE": str(cache), "KIW_SETUP_REDIS": "0"}
    p = subprocess.run(["bash", str(ROOT / "worker/local/setup_env.sh")], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == str(venv / "bin" / "python")
    assert "redis" not in p.stderr
