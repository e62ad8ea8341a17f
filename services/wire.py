"""Protobuf <-> engine conversions shared by the service edges (gateway, scheduler, workers)."""
from __future__ import annotations

from kvrelay.api.kvrelay.v1 import common_pb2
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured.spec import StructuredOutputs
from kvrelay.step_messages import TokenLogprob

# proto field -> SamplingParams field, for the `optional` scalars (unset keeps the default)
_OPTIONAL = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
             "repetition_penalty", "logprobs", "skip_special_tokens", "prompt_logprobs")
_PLAIN = ("min_tokens", "ignore_eos", "presence_penalty", "frequency_penalty",
          "disable_speculation")


def params_from_proto(message: common_pb2.SamplingParams,
                      default_max_tokens: int | None = None) -> SamplingParams:
    """Raises ValueError with a user-facing message for invalid values."""
    values = {name: getattr(message, name) for name in _OPTIONAL if message.HasField(name)}
    values.update({name: getattr(message, name) for name in _PLAIN})
    values["stop_token_ids"] = list(message.stop_token_ids)
    values["stop"] = list(message.stop)
    values["structured_outputs"] = structured_from_proto(message)
    values["logit_bias"] = {token: _round_float32(bias)
                            for token, bias in message.logit_bias.items()}
    if message.HasField("allowed_token_ids"):
        values["allowed_token_ids"] = list(message.allowed_token_ids.ids)
    values["bad_words_token_ids"] = [list(word.ids) for word in message.bad_words_token_ids]
    values["pooling"] = message.pooling or None
    values.setdefault("max_tokens", default_max_tokens)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if name in values:  # float32 on the wire: 0.1 arrives as 0.10000000149
            values[name] = _round_float32(values[name])
    return SamplingParams.from_dict(values)


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids,
        stop=params.stop, ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        skip_special_tokens=params.skip_special_tokens,
        disable_speculation=params.disable_speculation, pooling=params.pooling or "")
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    if params.structured_outputs is not None:
        message.structured_outputs.CopyFrom(structured_to_proto(params.structured_outputs))
    message.logit_bias.update(params.logit_bias)
    if params.allowed_token_ids is not None:
        message.allowed_token_ids.ids.extend(params.allowed_token_ids)
    message.bad_words_token_ids.extend(common_pb2.TokenIdList(ids=word)
                                       for word in params.bad_words_token_ids)
    return message


def structured_from_proto(message: common_pb2.SamplingParams) -> StructuredOutputs | None:
    if not message.HasField("structured_outputs"):
        return None
    spec = message.structured_outputs
    kind = spec.WhichOneof("kind")
    if kind is None:
        return None
    after = spec.after_reasoning
    if kind == "choice":
        return StructuredOutputs("choice", choices=tuple(spec.choice.choices),
                                 after_reasoning=after)
    if kind == "json_object":
        return StructuredOutputs("json_object", after_reasoning=after,
                                 whitespace_pattern=spec.whitespace_pattern) \
            if spec.json_object else None
    return StructuredOutputs(kind, getattr(spec, kind), after_reasoning=after,
                             whitespace_pattern=spec.whitespace_pattern)


def structured_to_proto(spec: StructuredOutputs) -> common_pb2.StructuredOutputs:
    after = spec.after_reasoning
    if spec.kind == "choice":
        return common_pb2.StructuredOutputs(choice=common_pb2.ChoiceList(choices=spec.choices),
                                            after_reasoning=after)
    if spec.kind == "json_object":
        return common_pb2.StructuredOutputs(json_object=True, after_reasoning=after,
                                            whitespace_pattern=spec.whitespace_pattern)
    return common_pb2.StructuredOutputs(**{spec.kind: spec.value}, after_reasoning=after,
                                        whitespace_pattern=spec.whitespace_pattern)


def _round_float32(value: float) -> float:
    return float(f"{value:.7g}")


def token_logprob_to_proto(entry: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
        top=[common_pb2.TopLogprob(token_id=token_id, logprob=logprob)
             for token_id, logprob in entry.top])


# A sequence's block tables, one per KV group (engine/kv_groups.py), travel as one id list and
# the groups' counts; one group (every model without windows) sends no counts.
def group_tables_to_wire(tables: tuple[tuple[int, ...], ...]) -> tuple[list[int], list[int]]:
    """-> (ids, group_block_counts)"""
    if len(tables) == 1:
        return list(tables[0]), []
    return [block_id for table in tables for block_id in table], [len(table) for table in tables]


def group_tables_from_wire(block_ids, counts) -> tuple[tuple[int, ...], ...]:
    if not counts:
        return (tuple(block_ids),)
    if sum(counts) != len(block_ids):
        raise ValueError(f"{len(block_ids)} block ids for group counts {list(counts)}")
    tables, start = [], 0
    for count in counts:
        tables.append(tuple(block_ids[start:start + count]))
        start += count
    return tuple(tables)
