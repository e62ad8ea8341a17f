"""LoRA adapters in the offline engine, float32: each adapter's greedy tokens equal
transformers + peft's; a batch mixing adapters and the base gives every request what it gets
alone; the prefix cache never serves one adapter's KV to another; bad adapters are refused at
load with the reason, and the loaded ones keep serving."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvrelay.engine import LLM, SamplingParams
from kvrelay.engine.lora.adapter_files import AdapterError
from tests.lora.conftest import MAX_NEW_TOKENS

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def _llm(lora_adapters, **kwargs) -> LLM:
    kwargs.setdefault("max_loras", 4)
    return LLM(dtype="float32", kv_cache_memory=128 << 20, enable_lora=True,
               lora_modules={name: path for name, (path, _) in lora_adapters.items()}, **kwargs)


def _tokens(llm, prompts, lora) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY,
                           use_tqdm=False, lora=lora)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def llm(lora_adapters):
    return _llm(lora_adapters)


def test_adapters_change_the_output(lora_references):
    """Parity below means something only if each adapter changes the base's tokens."""
    for name in ("all-r8", "qv-r16-rs", "o-down-r4"):
        assert lora_references[name] != lora_references[None], name


@pytest.mark.parametrize("name", ["all-r8", "qv-r16-rs", "o-down-r4", None])
def test_each_adapter_alone_matches_peft(llm, lora_prompts, lora_references, name):
    assert _tokens(llm, lora_prompts, name) == lora_references[name]


def test_mixed_batch_gives_each_request_its_own_tokens(llm, lora_prompts, lora_references):
    names = ["all-r8", None, "qv-r16-rs", "o-down-r4"]
    prompts = [ids for ids in lora_prompts for _ in names]
    loras = [name for _ in lora_prompts for name in names]
    got = _tokens(llm, prompts, loras)
    expected = [lora_references[name][index] for index in range(len(lora_prompts))
                for name in names]
    assert got == expected


def test_more_adapters_than_slots(lora_adapters, lora_prompts, lora_references):
    """Three adapters and the base through two slots: requests wait for a slot, none mixes."""
    llm = _llm(lora_adapters, max_loras=2)
    names = ["all-r8", "qv-r16-rs", "o-down-r4", None]
    got = _tokens(llm, [lora_prompts[0]] * 4, names)
    assert got == [lora_references[name][0] for name in names]


def test_prefix_cache_is_keyed_by_adapter(lora_adapters, lora_prompts, lora_references):
    """The same prompt under one adapter, then another: no block is shared across them (the
    second's tokens would be wrong if its prompt's KV came from the first), while a repeat
    under the same adapter hits."""
    llm = _llm(lora_adapters)
    prompt = lora_prompts[1]
    stats = llm.engine.scheduler.kv.stats
    _tokens(llm, [prompt], "qv-r16-rs")
    hits = stats.hits
    assert _tokens(llm, [prompt], "all-r8") == [lora_references["all-r8"][1]]
    assert stats.hits == hits  # nothing shared across adapters...
    assert _tokens(llm, [prompt], "qv-r16-rs") == [lora_references["qv-r16-rs"][1]]
    assert stats.hits > hits  # ...and shared within one


def test_unload_and_reload(lora_adapters, lora_prompts, lora_references):
    llm = _llm(lora_adapters)
    llm.unload_lora_adapter("all-r8")
    assert "all-r8" not in llm.list_lora_adapters()
    with pytest.raises(ValueError, match="no LoRA adapter named 'all-r8'"):
        _tokens(llm, lora_prompts[:1], "all-r8")
    llm.load_lora_adapter("again", lora_adapters["o-down-r4"][0])
    assert _tokens(llm, lora_prompts[:1], "again") == [lora_references["o-down-r4"][0]]
    assert _tokens(llm, lora_prompts[:1], "qv-r16-rs") == [lora_references["qv-r16-rs"][0]]


def _broken_copy(source: str, target: Path, edit) -> str:
    shutil.copytree(source, target)
    edit(target)
    return str(target)


def _edit_config(**changes):
    def edit(directory: Path) -> None:
        file = directory / "adapter_config.json"
        config = json.loads(file.read_text())
        config.update(changes)
        file.write_text(json.dumps(config))
    return edit


def _edit_tensors(change):
    def edit(directory: Path) -> None:
        file = directory / "adapter_model.safetensors"
        tensors = load_file(str(file))
        change(tensors)
        save_file(tensors, str(file))
    return edit


def _first_key(tensors, half="lora_A"):
    return next(key for key in sorted(tensors) if half in key)


BROKEN = {
    "dora": (_edit_config(use_dora=True), "use_dora"),
    "modules_to_save": (_edit_config(modules_to_save=["lm_head"]), "modules_to_save"),
    "bias": (_edit_config(bias="all"), "bias"),
    "not-lora": (_edit_config(peft_type="IA3"), "peft_type"),
    "wrong-shape": (_edit_tensors(lambda t: t.update(
        {_first_key(t): t[_first_key(t)][:, :100].contiguous()})), "another base model"),
    "missing-half": (_edit_tensors(lambda t: t.pop(_first_key(t, "lora_B"))), "no lora_B"),
    "embedding": (_edit_tensors(lambda t: t.update(
        {"base_model.model.model.embed_tokens.lora_embedding_A": t[_first_key(t)].clone()})),
        "unexpected tensor"),
    "bad-layer": (_edit_tensors(lambda t: t.update(
        {_first_key(t).replace("layers.0.", "layers.99.").replace("layers.1.", "layers.99."):
         t[_first_key(t)].clone()})), "layer 99"),
    "nan": (_edit_tensors(lambda t: t[_first_key(t)].fill_(float("nan"))), "non-finite"),
    "corrupt": (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x00" * 64),
                "cannot be read"),
    "no-weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "not found"),
}


def test_bad_adapters_refused_and_nothing_hurt(llm, lora_adapters, lora_prompts,
                                               lora_references, tmp_path):
    before = llm.list_lora_adapters()
    for case, (edit, reason) in sorted(BROKEN.items()):
        path = _broken_copy(lora_adapters["all-r8"][0], tmp_path / case, edit)
        with pytest.raises(AdapterError, match=reason):
            llm.load_lora_adapter(f"broken-{case}", path)
        assert llm.list_lora_adapters() == before, case
    assert _tokens(llm, lora_prompts, "all-r8") == lora_references["all-r8"]


def test_rank_above_the_limit_refused(lora_adapters):
    with pytest.raises(AdapterError, match="above --max-lora-rank 8"):
        _llm(lora_adapters, max_lora_rank=8)


def test_name_in_use_refused(llm, lora_adapters):
    with pytest.raises(ValueError, match="already in use"):
        llm.load_lora_adapter("all-r8", lora_adapters["all-r8"][0])
