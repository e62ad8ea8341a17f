"""A worker process sets GOMP_SPINCOUNT before torch (and with it libgomp) is first imported."""
import os
import subprocess
import sys
from pathlib import Path

from kvrelay.worker.openmp_spin import SPIN_COUNT

REPO = Path(__file__).resolve().parents[2]
# Records the variable at the moment torch starts loading, then imports the worker's entry
# module the way `kvrelay worker` does.
PROBE = """
import os, sys
seen = {}
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "at_torch_import" not in seen:
            seen["at_torch_import"] = os.environ.get("GOMP_SPINCOUNT")
        return None
sys.meta_path.insert(0, Probe())
import kvrelay.worker.main
print(seen.get("at_torch_import", "torch not imported"))
"""


def _spin_count_when_torch_loads(env: dict[str, str]) -> str:
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, check=True,
                            capture_output=True, text=True, timeout=120)
    return result.stdout.strip().splitlines()[-1]


def test_worker_sets_the_spin_count_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert _spin_count_when_torch_loads(env) == SPIN_COUNT


def test_a_spin_count_set_by_the_user_is_kept():
    env = dict(os.environ, GOMP_SPINCOUNT="123456")
    assert _spin_count_when_torch_loads(env) == "123456"
