"""``make demo``: what it runs, and that it needs no Redis (nor the root or sudo its install takes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_make_demo_passes_demo_args_and_skips_the_redis_setup() -> None:
    p = subprocess.run(["make", "-n", "-C", str(ROOT), "demo", "DEMO_ARGS=--records 20000 --rate 500"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "KIW_SETUP_REDIS=0" in p.stdout
    assert "-m worker demo --records 20000 --rate 500" in p.stdout


def test_setup_env_with_kiw_setup_redis_0_needs_no_redis_server(tmp_path: Path) -> None:
    # The venv the script would pick must exist already (a test must not install PyTorch): the same key as
    # setup_env.sh computes, for this interpreter's version and the default extras.
    pyver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    cache = Path(os.environ.get("KIW_CACHE", Path.home() / ".cache" / "kafka-inference-worker"))
    key = subprocess.run(["bash", "-c", 'pyver=$1; extras="test,models,dev,onnx,bench,reference"; '
                          '{ echo "$pyver $extras"; awk \'/^dependencies = \\[/{on=1} /^\\[project.scripts\\]/{on=0} on\' '
                          '"$2/pyproject.toml"; } | sha256sum | cut -c1-12', "_",
                          pyver, str(ROOT)], capture_output=True, text=True).stdout.strip()
    venv = cache / f"venv-py{pyver}-{key}"
    if not (venv / ".complete").exists() or "KIW_EXTRAS" in os.environ:
        pytest.skip(f"no ready virtual environment at {venv}")
    # A PATH without redis-server, apt-get or sudo: installing it could only fail.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            if name not in ("redis-server", "apt-get", "sudo") and not (bin_dir / name).exists():
                (bin_dir / name).symlink_to(os.path.join(d, name))
    env = {**os.environ, "PATH": str(bin_dir), "PYTHON": sys.executable, "KIW_CACHE": str(cache),
           "KIW_SETUP_REDIS": "0"}
    p = subprocess.run(["bash", str(ROOT / "worker/local/setup_env.sh")], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == str(venv / "bin" / "python")
    assert "redis" not in p.stderr
