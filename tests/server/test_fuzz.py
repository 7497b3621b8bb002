"""Property-based fuzzing from the server's own /openapi.json (schemathesis): boundary values, wrong types and
random bodies on every operation; none may get a 5xx. Bounded: a fixed seed, few examples per operation, and the
small server's 96-token context keeps each generation short."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("schemathesis")
ROOT = Path(__file__).resolve().parents[2]


def test_fuzzing_the_openapi_schema_finds_no_server_error(small_server, tmp_path):
    st = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.fuzz_hooks",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [st, "run", f"{small_server.base_url}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "10",
         "--seed", "3", "--workers", "1", "--request-timeout", "60", "--no-shrink", "--rate-limit", "auto"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    tail = "\n".join(result.stdout.splitlines()[-40:])
    assert result.returncode == 0, tail
    assert "Server error" not in result.stdout and "passed" in result.stdout, tail
    assert small_server.healthy()
