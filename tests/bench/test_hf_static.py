"""benchmarks/peers/hf_static.py runs in the transformers peer's venv, which has no kvrelay: it
must run with kvrelay unimportable, on the conversations file static_command writes."""
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.peers import hf_transformers

# Runs the script as __main__ with every kvrelay import failing, as in the peer's venv.
WITHOUT_KVRELAY = ("import runpy, sys; sys.modules['kvrelay'] = None; sys.argv = sys.argv[1:]; "
                   "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_static_batching_runs_without_kvrelay_on_the_written_conversations(tmp_path):
    out = tmp_path / "result.json"
    command = hf_transformers.static_command(
        Path(sys.executable), "float32", threads=1, batch_size=2, out=out,
        max_requests=2, max_tokens=3)
    conversations = json.loads((tmp_path / "conversations.json").read_text())
    assert len(conversations) == 2 and conversations[0][-1]["role"] == "user"
    subprocess.run([sys.executable, "-c", WITHOUT_KVRELAY, *command[1:]], check=True,
                   timeout=300, env={**os.environ, **hf_transformers.offline_env(1)})
    result = json.loads(out.read_text())
    assert (result["requests"], result["output_tokens"]) == (2, 6)
