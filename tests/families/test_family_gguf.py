"""GGUF files of tiny random checkpoints (gguf_writer.py: llama.cpp's layout) through kvrelay's
GGUF path (model_loader.py converts them through transformers): in F32 the greedy tokens equal
those of the safetensors twin and of transformers; in Q4_0 (head and embedding Q8_0) the small
steps run on the file's own 4-bit blocks (gguf_int4.py, checked there against the loaded
weights, so blocks of the wrong rows refuse to load) and agree with the same model with those
kernels off within bf16's tolerance; an architecture no family builds is refused before
converting."""
from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3Config

from kvrelay.engine import LLM, SamplingParams
from kvrelay.engine.model_loader import resolve_model_dir
from kvrelay.engine.models import gguf_int4
from kvrelay.kernels import native_gemv
from tests.conftest import reference_logprobs
from tests.families.checkpoints import COMMON, write_model
from tests.families.gguf_writer import write_gguf

NEW_TOKENS = 24
PROMPTS = [[1, 5, 9, 200, 3000, 17] * 4, [1, 42, 7] * 9, [1] + list(range(100, 160, 3))]
# weights larger than transformers' default initialisation, so the logits are spread over
# nats and a greedy choice is rarely a near-tie that bf16 rounding may flip
GGUF_TWINS = {
    "qwen3": lambda: Qwen3Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False,
                                 initializer_range=0.3),
    # Gemma 3: norms stored as 1 + w; tied head. The file holds no query scale, which
    # transformers reads as Gemma3TextConfig's query_pre_attn_scalar of 256 (the real models'
    # head size; llama.cpp would take this tiny model's 16). The window spans the context: the
    # windows themselves are test_family_parity.py's
    "gemma3": lambda: Gemma3TextConfig(**COMMON, num_hidden_layers=2,
                                       sliding_window=COMMON["max_position_embeddings"],
                                       query_pre_attn_scalar=256, initializer_range=0.3),
    # Llama: llama.cpp permutes its q/k rows, which transformers and gguf_int4 undo
    "llama": lambda: LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=True,
                                 initializer_range=0.3),
}
# as tests/test_int4_weights.py: a token that differs from the reference's best lies within
# NEAR_TIE nats of it, and the engine's logprob of its token within LOGPROB_GAP of the reference's
NEAR_TIE = 0.25
LOGPROB_GAP = 0.5
SMALL_STEPS_OFF = dict(int4_max_tokens=0, amx_max_tokens=0, q4a8_max_tokens=0)


@pytest.fixture(autouse=True, scope="module")
def conversion_cache(tmp_path_factory, model_dir):
    """This module's converted GGUFs go to a folder of its own, not the user's cache (the
    default model's conversion, model_dir, stays there: it takes a minute)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVRELAY_CACHE_DIR", str(tmp_path_factory.mktemp("kvrelay-cache")))
        yield


def _greedy(llm: LLM, prompts: list[list[int]], together: bool = True) -> list:
    """The completions (token_ids, logprobs of each chosen token); decoded together (steps of
    len(prompts) rows) or each alone (steps of one row)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    if together:
        return [o.outputs[0] for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    return [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
            for p in prompts]


def _hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        output = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False)
    return output[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=sorted(GGUF_TWINS))
def twin(request, tmp_path_factory, model_dir):
    """(architecture, folder with the safetensors twin and its GGUF files, the HF model)."""
    folder = tmp_path_factory.mktemp(f"gguf-{request.param}")
    hf_model = write_model(GGUF_TWINS[request.param](), folder / "safetensors", model_dir)
    write_gguf(hf_model, folder / "f32.gguf")
    write_gguf(hf_model, folder / "q4_0.gguf", "Q4_0")
    return request.param, folder, hf_model


def test_f32_gguf_greedy_tokens_equal_the_safetensors_twin_and_hf(twin):
    name, folder, hf_model = twin
    from_gguf = LLM(model=str(folder / "f32.gguf"), dtype="float32", num_kv_blocks=64)
    from_safetensors = LLM(model=str(folder / "safetensors"), dtype="float32", num_kv_blocks=64)
    for prompt, gguf_out, twin_out in zip(PROMPTS, _greedy(from_gguf, PROMPTS),
                                          _greedy(from_safetensors, PROMPTS)):
        assert gguf_out.token_ids == twin_out.token_ids == _hf_greedy(hf_model, prompt), name


def test_the_converted_f32_gguf_holds_the_twins_weights(twin):
    """Weight for weight (names as the safetensors twin's): the permutation and layout undone.
    Gemma's norms went through 1 + w and back, in float32, so they are compared so rounded."""
    name, folder, hf_model = twin
    converted = AutoModelForCausalLM.from_pretrained(resolve_model_dir(str(folder / "f32.gguf")),
                                                     dtype=torch.float32)
    expected = hf_model.state_dict()
    for param_name, tensor in converted.state_dict().items():
        want = expected[param_name]
        if name.startswith("gemma") and "norm" in param_name:
            want = (want + 1) - 1
        torch.testing.assert_close(tensor, want, atol=0, rtol=0, msg=param_name)


def _check_against_reference(hf_model, prompts, completions, label: str) -> None:
    """Teacher-forced against HF float32 on the same (dequantized) weights, with the int4 tests'
    bounds per token: the reference's argmax or a near-tie of it, its logprob within
    LOGPROB_GAP. (Not their share of argmax tokens: a random model's logits are no language
    model's, its near-ties more frequent.)"""
    for prompt, completion in zip(prompts, completions):
        reference = reference_logprobs(hf_model, prompt, completion.token_ids)
        chosen = reference[torch.arange(NEW_TOKENS), torch.tensor(completion.token_ids)]
        margins = reference.max(-1).values - chosen
        assert margins.max().item() < NEAR_TIE, f"{label}: {margins.max().item():.3f} nats"
        engine = torch.tensor([entry[token].logprob for entry, token
                               in zip(completion.logprobs, completion.token_ids)])
        assert (engine - chosen).abs().max().item() < LOGPROB_GAP, label


def _check_same_until_a_near_tie(hf_model, prompt, on, off, label: str) -> None:
    """The two engines' tokens are the same up to their first difference, where the two
    tokens are a near-tie of the float32 reference (after it the prefixes differ)."""
    differ = next((i for i, (a, b) in enumerate(zip(on.token_ids, off.token_ids)) if a != b),
                  None)
    if differ is None:
        return
    reference = reference_logprobs(hf_model, prompt, on.token_ids)[differ]
    gap = abs(reference[on.token_ids[differ]] - reference[off.token_ids[differ]]).item()
    assert gap < NEAR_TIE, f"{label}: position {differ}, {gap:.3f} nats apart"


def test_q4_0_gguf_small_steps_run_on_its_own_blocks(twin):
    name, folder, _ = twin
    if native_gemv.gemv_ops() is None and not gguf_int4.int4_supported():
        pytest.skip("no int4 kernel on this machine")
    path = str(folder / "q4_0.gguf")
    with_kernels = LLM(model=path, dtype="bfloat16", num_kv_blocks=64)
    without = LLM(model=path, dtype="bfloat16", num_kv_blocks=64, **SMALL_STEPS_OFF)
    runner = with_kernels.engine.runner
    assert runner.uses_int4, f"{name}: the file's Q4_0 layer matmuls run the small steps"
    assert runner.q8_head == (runner.int4_kernel == "native"), "its Q8_0 head too"
    assert not without.engine.runner.uses_int4
    hf_model = AutoModelForCausalLM.from_pretrained(with_kernels.engine.model_dir,
                                                    dtype=torch.float32).eval()
    for together in (False, True):  # one-row steps, then steps of len(PROMPTS) rows
        on, off = _greedy(with_kernels, PROMPTS, together), _greedy(without, PROMPTS, together)
        label = f"{name}, {'together' if together else 'alone'}"
        _check_against_reference(hf_model, PROMPTS, on, f"{label}, kernels on")
        _check_against_reference(hf_model, PROMPTS, off, f"{label}, kernels off")
        for prompt, on_out, off_out in zip(PROMPTS, on, off):
            _check_same_until_a_near_tie(hf_model, prompt, on_out, off_out, label)


def test_a_gguf_of_an_architecture_without_a_family_is_refused(tmp_path, model_dir):
    hf_model = write_model(GGUF_TWINS["qwen3"](), tmp_path / "safetensors", model_dir)
    path = write_gguf(hf_model, tmp_path / "stablelm.gguf", arch="stablelm")
    with pytest.raises(ValueError, match="GGUF architecture 'stablelm' is not supported; "
                       "kvrelay serves GGUF architectures gemma2, gemma3, llama, phi3, qwen2, "
                       "qwen3, qwen3moe"):
        LLM(model=str(path), dtype="float32")
