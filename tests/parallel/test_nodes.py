"""Where a pipeline's stages run across hosts, and which interface gloo talks on."""
from __future__ import annotations

import os

import pytest

from kvrelay.engine.parallel.nodes import GLOO_INTERFACE_ENV, NodePlacement, interface_towards


def test_each_host_runs_a_run_of_consecutive_stages():
    assert [NodePlacement(2, rank, "h:1").stages_here(4) for rank in (0, 1)] == [
        range(0, 2), range(2, 4)]
    assert NodePlacement(3, 2, "h:1").stages_here(3) == range(2, 3)
    assert NodePlacement().stages_here(3) == range(0, 3)  # one host: every stage


def test_the_rendezvous_is_node_zeros_address_or_a_free_local_port():
    assert NodePlacement(2, 1, "10.1.2.3:29500").init_method() == "tcp://10.1.2.3:29500"
    assert NodePlacement(2, 1, "[fd00::1]:29500").init_method() == "tcp://[fd00::1]:29500"
    assert NodePlacement().init_method().startswith("tcp://127.0.0.1:")


def test_the_interface_is_the_one_that_routes_to_node_zero(monkeypatch):
    assert interface_towards("127.0.0.1") == "lo"
    assert interface_towards("no-such-host.invalid") is None
    _unset(monkeypatch)
    NodePlacement(2, 1, "127.0.0.1:29500").choose_gloo_interface()
    assert os.environ[GLOO_INTERFACE_ENV] == "lo"
    monkeypatch.setenv(GLOO_INTERFACE_ENV, "eth7")  # the operator's choice wins
    NodePlacement(2, 1, "127.0.0.1:29500").choose_gloo_interface()
    assert os.environ[GLOO_INTERFACE_ENV] == "eth7"


def _unset(monkeypatch) -> None:
    """The variable absent for the test, and absent again after it whatever the code under
    test set (monkeypatch restores only what it changed itself: set it first, then delete)."""
    monkeypatch.setenv(GLOO_INTERFACE_ENV, "")
    monkeypatch.delenv(GLOO_INTERFACE_ENV)


def test_one_host_leaves_gloo_alone(monkeypatch):
    _unset(monkeypatch)
    NodePlacement().choose_gloo_interface()
    assert GLOO_INTERFACE_ENV not in os.environ


@pytest.mark.parametrize("placement,reason", [
    (NodePlacement(2, 0, None), "needs --dist-init-address"),
    (NodePlacement(2, 0, "host:0"), "must be HOST:PORT"),
    (NodePlacement(2, 0, ":29500"), "must be HOST:PORT"),
    (NodePlacement(1, 0, "10.0.0.1:29500"), "is node 0's rendezvous for --nnodes > 1"),
])
def test_a_placement_that_cannot_be_made_is_refused(placement, reason):
    with pytest.raises(ValueError, match=reason):
        placement.check(2, 1)


def test_another_host_finds_the_leaders_checkpoint_and_refuses_another(tmp_path, model_dir):
    """Another host loads the checkpoint from its own path (the leader's --model, or its own
    --model where it keeps the files elsewhere), and refuses one whose config is not the
    leader's."""
    import shutil

    from transformers import AutoConfig

    from kvrelay.engine.parallel.followers import checkpoint_here
    from tests.families.checkpoints import write_checkpoint
    write_checkpoint("llama3", tmp_path / "leader", model_dir)
    shutil.copytree(tmp_path / "leader", tmp_path / "mounted-elsewhere")
    write_checkpoint("qwen3", tmp_path / "other", model_dir)
    leaders = (AutoConfig.from_pretrained(tmp_path / "leader"), tmp_path / "leader", "rest")
    assert checkpoint_here(leaders, str(tmp_path / "leader"))[1:] == (tmp_path / "leader",
                                                                      "rest")
    here = checkpoint_here(leaders, str(tmp_path / "mounted-elsewhere"))
    assert here[1] == tmp_path / "mounted-elsewhere" and here[0] is leaders[0]
    with pytest.raises(ValueError, match="is not the leader's"):
        checkpoint_here(leaders, str(tmp_path / "other"))
