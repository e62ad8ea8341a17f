"""The tokenizer service over real gRPC on the default model's tokenizer."""
from __future__ import annotations

import grpc
import pytest

from kvrelay.api.kvrelay.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

TEXTS = ["Hello, world! Plain ASCII text.", "你好，世界！今天天气很好。",
         "Rockets 🚀, coders 👩‍💻 and flags 🇫🇷.", "Ünïcödé àccents, Ελληνικά, русский."]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour 🎨."}]


@pytest.fixture(scope="module")
def stub(tokenizer_address):
    with grpc.insecure_channel(tokenizer_address) as channel:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)


def _chat_request(messages, add_generation_prompt=True):
    return tokenizer_pb2.EncodeRequest(chat=tokenizer_pb2.ChatRender(
        messages=[common_pb2.ChatMessage(**m) for m in messages],
        add_generation_prompt=add_generation_prompt))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(stub, tokenizer, text):
    ids = list(stub.Encode(tokenizer_pb2.EncodeRequest(prompt=text, add_special_tokens=True))
               .token_ids)
    assert ids == tokenizer.encode(text, add_special_tokens=True)
    decoded = stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids, skip_special_tokens=True))
    assert decoded.text == text


def test_chat_equals_the_models_chat_template(stub, tokenizer):
    for add_generation_prompt in (True, False):
        ids = stub.Encode(_chat_request(CHAT, add_generation_prompt)).token_ids
        expected = tokenizer.apply_chat_template(
            CHAT, add_generation_prompt=add_generation_prompt, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert list(ids) == list(expected)
    assert stub.Encode(_chat_request(CHAT)).token_ids != stub.Encode(
        _chat_request(CHAT, False)).token_ids


def _token_by_token_batches(texts_ids: dict[str, list[int]]):
    """One batch per step, every stream gets its next token; the last token finishes it."""
    longest = max(len(ids) for ids in texts_ids.values())
    for step in range(longest):
        items = [tokenizer_pb2.DetokenizeItem(
            request_id=stream_id, new_token_ids=ids[step:step + 1],
            finished=step == len(ids) - 1, skip_special_tokens=True)
            for stream_id, ids in texts_ids.items() if step < len(ids)]
        yield tokenizer_pb2.DetokenizeBatch(items=items)


def test_streamed_detokenize_equals_full_decode(stub, tokenizer):
    streams = {f"req-{i}/0": tokenizer.encode(text) for i, text in enumerate(TEXTS)}
    batches = list(_token_by_token_batches(streams))
    texts = {stream_id: [] for stream_id in streams}
    results = list(stub.Detokenize(iter(batches)))
    assert len(results) == len(batches)
    for batch, result in zip(batches, results):
        assert [r.request_id for r in result.results] == [i.request_id for i in batch.items]
        for item in result.results:
            assert "\ufffd" not in item.text
            texts[item.request_id].append(item.text)
    for (stream_id, ids), text in zip(streams.items(), TEXTS):
        assert "".join(texts[stream_id]) == tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(texts[stream_id]) == text


def test_finished_forgets_the_state_and_pieces_are_each_tokens_text(stub, tokenizer):
    first, second = tokenizer.encode("你好"), tokenizer.encode("🚀 go")
    batches = [tokenizer_pb2.DetokenizeBatch(items=[tokenizer_pb2.DetokenizeItem(
                   request_id="r/0", new_token_ids=first, finished=True,
                   piece_token_ids=first)]),
               # the same id again after `finished`: a fresh stream, no leftover bytes
               tokenizer_pb2.DetokenizeBatch(items=[tokenizer_pb2.DetokenizeItem(
                   request_id="r/0", new_token_ids=second, finished=True)])]
    results = list(stub.Detokenize(iter(batches)))
    assert [r.results[0].text for r in results] == ["你好", "🚀 go"]
    tokens = tokenizer.convert_ids_to_tokens(first)
    assert list(results[0].results[0].pieces) == [
        tokenizer.convert_tokens_to_string([token]) for token in tokens]
    assert len(results[0].results[0].pieces) == len(first)


def test_special_tokens_kept_or_skipped(stub, tokenizer):
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id]
    items = [tokenizer_pb2.DetokenizeItem(request_id=f"s/{skip}", new_token_ids=ids,
                                          finished=True, skip_special_tokens=skip)
             for skip in (True, False)]
    result = next(stub.Detokenize(iter([tokenizer_pb2.DetokenizeBatch(items=items)])))
    assert [r.text for r in result.results] == ["hi", "hi" + tokenizer.eos_token]


@pytest.mark.parametrize("request_", [
    _chat_request([]),
    _chat_request([{"role": "user", "content": "hi"}, {"role": "", "content": "x"}]),
    tokenizer_pb2.EncodeRequest(),
], ids=["empty-chat", "chat-missing-role", "no-input"])
def test_bad_encode_is_invalid_argument(stub, request_):
    with pytest.raises(grpc.RpcError) as info:
        stub.Encode(request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details()


def test_out_of_vocabulary_ids_are_invalid_argument(stub, tokenizer):
    bad = [len(tokenizer) + 5]
    with pytest.raises(grpc.RpcError) as info:
        stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocabulary" in info.value.details()
    batch = tokenizer_pb2.DetokenizeBatch(items=[tokenizer_pb2.DetokenizeItem(
        request_id="x/0", new_token_ids=bad)])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Detokenize(iter([batch])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_stream_resumed_on_a_new_detokenize_stream_continues_its_text(stub, tokenizer):
    """What a caller sends when its stream broke: the tokens whose text it got, then the rest.
    Split mid-character (a byte of "界" answered, held back, then lost with the stream), the
    text goes on with exactly what was missing; resume tokens for an id that already has a
    state on the stream are refused (the caller would get text twice)."""
    ids = tokenizer.encode("你好，世界！🚀")
    split = next(k for k in range(len(ids)) if tokenizer.decode(ids[:k]).endswith("世\ufffd"))
    old = list(stub.Detokenize(iter(
        [tokenizer_pb2.DetokenizeBatch(items=[tokenizer_pb2.DetokenizeItem(
            request_id="r/0", new_token_ids=ids[:split], skip_special_tokens=True)])])))
    new = list(stub.Detokenize(iter([tokenizer_pb2.DetokenizeBatch(items=[
        tokenizer_pb2.DetokenizeItem(request_id="r/0", resume_token_ids=ids[:split],
                                     new_token_ids=ids[split:split + 1],
                                     skip_special_tokens=True)]),
        tokenizer_pb2.DetokenizeBatch(items=[tokenizer_pb2.DetokenizeItem(
            request_id="r/0", new_token_ids=ids[split + 1:], finished=True,
            skip_special_tokens=True)])])))
    texts = [old[0].results[0].text] + [result.results[0].text for result in new]
    assert texts[0] == "你好，世" and "".join(texts) == "你好，世界！🚀"
    twice = tokenizer_pb2.DetokenizeItem(request_id="r/0", resume_token_ids=ids[:2])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Detokenize(iter([tokenizer_pb2.DetokenizeBatch(items=[twice]),
                                   tokenizer_pb2.DetokenizeBatch(items=[twice])])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already has a detokenizer state" in info.value.details()
