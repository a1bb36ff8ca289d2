"""scripts/env.sh: two clones sharing the cached environment each import their own code (in the shell and in the
processes it starts), even when the other clone sets up in between; neither re-points the shared install."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the project's git checkout to clone")
def test_two_clones_each_import_their_own_code(tmp_path):
    for name in ("a", "b"):
        subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(tmp_path / name)], check=True)
    # clone a sets up; clone b sets up while a's shell lives (a CI checkout beside a user's); a's next process must
    # still import a's code. It is started from / so that the current directory cannot answer for the package.
    probe = (". scripts/env.sh && (cd ../b && . scripts/env.sh) && cd / && "
             "python -c 'import mmrlhf, os; print(os.path.dirname(mmrlhf.__file__))'")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(["bash", "-c", probe], cwd=tmp_path / "a", env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(tmp_path / "a" / "mmrlhf")
