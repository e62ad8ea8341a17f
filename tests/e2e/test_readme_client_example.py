"""The README's gRPC client example (`from kvrelay.client import KvrelayClient`) runs as written
against a real stack; only the address it dials becomes the test stack's."""
from tests.readme_examples import readme_example, run_example

README_ADDRESS = "127.0.0.1:50050"


def test_the_client_example_runs_as_written(pd_stack):
    source = readme_example("client")
    assert "from kvrelay.client import KvrelayClient" in source and README_ADDRESS in source
    output = run_example(source.replace(README_ADDRESS, pd_stack.grpc_address), timeout=300)
    # The streamed text, then the chat result's text, its finish reason and usage.
    last = output.stdout.strip().splitlines()[-1]
    assert any(reason in last for reason in ("length", "stop")) and "completion_tokens" in last
