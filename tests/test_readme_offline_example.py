"""The README's offline example (`from kvrelay import LLM, SamplingParams`) runs as written."""
import re

from tests.readme_examples import readme_example, run_example


def test_the_offline_example_runs_as_written():
    source = readme_example("offline")
    assert "from kvrelay import LLM, SamplingParams" in source
    output = run_example(source, timeout=600).stdout
    # Each of the two prompts' text is printed with its finish reason after it (the texts may
    # span lines), then the chat reply.
    assert len(re.findall(r" (length|stop)$", output, flags=re.MULTILINE)) >= 2
    assert output.rstrip().splitlines()[-1].strip()
