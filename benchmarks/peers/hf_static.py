"""HF transformers static batching on chat-64: `model.generate` on batches of left-padded
prompts, each batch finishing together. Runs in the transformers peer's own venv, which has
torch and transformers but not kvrelay: the conversations come in a JSON file that the caller
writes (hf_transformers.static_command does, from kvrelay's chat-64 prompts).

    <peer venv>/bin/python benchmarks/peers/hf_static.py --model-dir DIR \
        --conversations FILE [--batch-size 16]

Prints and writes (--json) output tokens/s and wall time; static batching has no per-request
TTFT or ITL (the whole batch returns at once).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer


def generate_all(model, tokenizer, texts: list[str], batch_size: int, max_tokens: int) -> int:
    """Output tokens generated; every sequence runs to max_tokens (ignore_eos's equivalent)."""
    output_tokens = 0
    for offset in range(0, len(texts), batch_size):
        batch = tokenizer(texts[offset:offset + batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        output_tokens += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return output_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--conversations", type=Path, required=True,
                        help="JSON: a list of chat conversations (lists of messages)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model_dir,
                                                 dtype=getattr(torch, args.dtype)).eval()
    conversations = json.loads(args.conversations.read_text())
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
             for c in conversations]
    generate_all(model, tokenizer, texts[:args.batch_size], args.batch_size, 4)  # warm-up
    start = time.perf_counter()
    output_tokens = generate_all(model, tokenizer, texts, args.batch_size, args.max_tokens)
    wall = time.perf_counter() - start
    result = {"system": f"HF static batching (batch {args.batch_size}, left padding)",
              "requests": len(texts), "output_tokens": output_tokens, "wall_s": wall,
              "output_tokens_per_s": output_tokens / wall, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "batch_size": args.batch_size,
              "versions": f"transformers {transformers.__version__}, "
                          f"torch {torch.__version__}"}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
