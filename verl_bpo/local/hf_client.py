"""In-process rollout with a local Hugging Face model: an :class:`~verl_bpo.rollout.protocols.LLMClient` and a chat
codec.

verl serves the policy through vLLM/SGLang and tokenizes turns with its continuous-token builder; these two classes
stand in for both when no server runs (the tree picture of the CPU demo, and ``benchmarks/learning.py``, which
trains many seeds in one process). The tree sampler and the estimators are the same code either way.

:class:`BatchedHFClient` gathers the generate calls that arrive together — one sampler wave, across every tree in
flight — into one left-padded ``model.generate``, so a batch of trees costs a few batched forward passes per turn.
The ``generate`` runs on a thread, not on the event loop: the loop keeps serving the sandbox calls and their time
limits meanwhile. On the loop, a wave that generated for longer than ``bpo.step_timeout_s`` (an evaluation of 128
TextWorld episodes on a busy 2-core box) fired the limits of engine calls that had returned in milliseconds, and the
failed leaves read as lost episodes.

A turn's prompt is the previous turn's prompt and response plus the new observation, so recomputing the whole chat
each turn spent most of a multi-turn rollout on tokens already seen (an evaluation of 64 TextWorld episodes: 85% of
its wall in ``generate``, prompts of about 580 tokens for turns of 1-6). :class:`PrefixCache` keeps each generated
sequence's keys and values, as vLLM's prefix caching does, and a request then prefills only what its longest cached
prefix lacks. The cache holds one policy's values: whoever changes the weights calls :meth:`BatchedHFClient.forget`.

Each request samples from its own generator, seeded by its ``sampling_params["seed"]`` (the tree sampler's
``seeded_turns``) or else by a draw from torch's global generator: with engine processes as sandboxes, which requests
share a batch depends on when their observations came back, and one generator shared by the batch made every draw
depend on that timing, so no rollout could be drawn twice.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from verl_bpo.rollout.protocols import Transcript

__all__ = ["Generation", "PrefixCache", "BatchedHFClient", "TemplateCodec"]


@dataclasses.dataclass
class Generation:
    """What verl's server returns for one request: sampled token ids and their log-probabilities."""

    token_ids: list[int]
    log_probs: list[float]


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None
    future: asyncio.Future


class _RowSampler:
    """A ``generate`` logits processor that draws each row's next token with the row's own generator and leaves it
    the only finite score, so that ``generate``'s greedy step takes it. The draw is the exponential race, argmax of
    p_i / E_i with E_i ~ Exp(1) independent, which picks token i with probability p_i = softmax(logits / T)_i: an
    exact sample whose randomness belongs to the row, not to its batch."""

    def __init__(self, seeds: Sequence[int], temperature: float) -> None:
        import torch

        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.temperature = temperature

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        logits = scores.float() / self.temperature
        race = torch.stack([torch.empty(scores.shape[-1]).exponential_(generator=g) for g in self.generators])
        race = race.to(scores.device)
        choice = (logits - race.log()).argmax(-1)
        only = torch.full_like(scores, float("-inf"))
        only[torch.arange(len(choice)), choice] = 0.0
        return only


class PrefixCache:
    """Keys and values of token sequences the policy has processed, least recently used evicted first.

    An entry is one sequence's per-layer ``(key, value)`` tensors, each ``(kv_heads, length, head_dim)``, stored
    under its token ids. :meth:`longest` finds the longest stored sequence that is a strict prefix of a prompt (a
    request must leave at least one token to compute, the one whose logits sample the first new token).

    Args:
        max_tokens: most tokens held over all entries (``0``: the cache is off).
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[tuple[int, ...], list[tuple[Any, Any]]] = collections.OrderedDict()
        self._lengths: collections.Counter[int] = collections.Counter()  # entry lengths, for the prefix search
        self.tokens = 0
        self.hits = self.misses = 0

    def longest(self, ids: Sequence[int]) -> tuple[int, list[tuple[Any, Any]] | None]:
        """``(length, layers)`` of the longest stored strict prefix of ``ids``; ``(0, None)`` when there is none."""
        for length in sorted((n for n in self._lengths if n < len(ids)), reverse=True):
            key = tuple(ids[:length])
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return length, self._entries[key]
        self.misses += 1
        return 0, None

    def put(self, ids: Sequence[int], layers: list[tuple[Any, Any]]) -> None:
        key = tuple(ids)
        if not self.max_tokens or len(key) > self.max_tokens or key in self._entries:
            return
        self._entries[key] = layers
        self._lengths[len(key)] += 1
        self.tokens += len(key)
        while self.tokens > self.max_tokens:
            old, _ = self._entries.popitem(last=False)
            self._lengths[len(old)] -= 1
            if not self._lengths[len(old)]:
                del self._lengths[len(old)]
            self.tokens -= len(old)

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.tokens = 0


class BatchedHFClient:
    """Samples turns from a local causal LM, batching concurrent requests.

    Args:
        model: a ``transformers`` causal LM (its weights may change between calls: training reuses it).
        tokenizer: its tokenizer (``pad_token_id`` and ``eos_token_id`` are used).
        temperature: sampling temperature (log-probs are of the tempered distribution, as the servers return).
        max_batch: most sequences in one ``generate`` call.
        gather_s: how long the first request of a batch waits for the rest of its wave.
        cache_tokens: most tokens whose keys and values are kept for later turns (:class:`PrefixCache`; 0: off).
            The default holds 256 MiB of the tiny models' values (1 KiB a token).
    """

    def __init__(self, model: Any, tokenizer: Any, temperature: float = 1.0, max_batch: int = 64,
                 gather_s: float = 0.002, cache_tokens: int = 1 << 18) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.cache = PrefixCache(cache_tokens)
        self.temperature, self.max_batch, self.gather_s = temperature, max_batch, gather_s
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id])
        self._pending: list[_Request] = []
        self._flusher: asyncio.Task | None = None
        self.calls = 0  # batched generate calls made (a measure of how well requests were gathered)

    def forget(self) -> None:
        """Drop the cached keys and values: call it whenever the weights change."""
        self.cache.clear()

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> Generation:
        future = asyncio.get_running_loop().create_future()
        seed = sampling_params.get("seed")
        self._pending.append(_Request(list(prompt_ids), int(sampling_params.get("max_tokens", 16)),
                                      None if seed is None else int(seed), future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:  # requests that arrive while a wave generates make the next wave
            seen = -1
            while seen != len(self._pending):  # wait until the wave stops growing
                seen = len(self._pending)
                await asyncio.sleep(self.gather_s)
            wave, self._pending = self._pending, []
            for batch, outcome in await asyncio.to_thread(self._generate_wave, wave):
                for row, request in enumerate(batch):
                    if isinstance(outcome, Exception):  # hand the error to every waiting caller rather than hang them
                        request.future.set_exception(outcome)
                    else:
                        request.future.set_result(outcome[row])

    def _generate_wave(self, wave: list[_Request]) -> list[tuple[list[_Request], list[Generation] | Exception]]:
        """Each batch of ``wave`` (``max_batch`` requests at most) with its generations or the error it raised. The
        whole wave generates before any caller resumes, so the batches do not depend on thread timing."""
        outcomes: list[tuple[list[_Request], list[Generation] | Exception]] = []
        for start in range(0, len(wave), self.max_batch):
            batch = wave[start: start + self.max_batch]
            try:
                outcomes.append((batch, self._generate_batch(batch)))
            except Exception as exc:
                outcomes.append((batch, exc))
        return outcomes

    def _generate_batch(self, batch: list[_Request]) -> list[Generation]:
        """Sample each request's turn in one left-padded ``generate``; rows whose prompt extends a cached sequence
        feed only their last tokens, the rest coming from the cache (layout: :meth:`_cached_past`)."""
        import torch

        self.calls += 1
        pad = self.tokenizer.pad_token_id
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, request in enumerate(batch):  # left padding: every prompt ends where generation starts
            ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
            attention[row, width - len(request.prompt_ids):] = 1
        past = self._cached_past(batch, width)
        seeds = [int(torch.randint(2**31, ())) if r.seed is None else r.seed for r in batch]
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():  # the sampling is _RowSampler's: generate's own (greedy) step takes its draws
            out = self.model.generate(ids, attention_mask=attention, do_sample=False,
                                      logits_processor=[_RowSampler(seeds, self.temperature)],
                                      max_new_tokens=max(r.max_tokens for r in batch), output_logits=True,
                                      return_dict_in_generate=True, pad_token_id=pad, past_key_values=past,
                                      use_cache=True)
        self.model.train(was_training)
        new = out.sequences[:, width:]
        log_probs = torch.stack([torch.log_softmax(s.float() / self.temperature, -1) for s in out.logits], 1)
        picked = log_probs.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        results = []
        for row, request in enumerate(batch):
            tokens = new[row, : request.max_tokens].tolist()
            end = next((i + 1 for i, t in enumerate(tokens) if t in self.eos_ids), len(tokens))
            results.append(Generation(tokens[:end], picked[row, :end].tolist()))
            if self.cache.max_tokens:
                # Every token but the last sampled one went through the model: the next turn extends them.
                start, stop = width - len(request.prompt_ids), width + end - 1
                self.cache.put(request.prompt_ids + tokens[: end - 1],
                               [(layer.keys[row, :, start:stop].clone(), layer.values[row, :, start:stop].clone())
                                for layer in out.past_key_values.layers])
        return results

    def _cached_past(self, batch: list[_Request], width: int) -> Any:
        """A ``DynamicCache`` of the batch's first ``width - fresh`` positions, or ``None`` when no row has a cached
        prefix. ``fresh`` is the most tokens a row lacks in the cache: every row feeds its last ``fresh`` tokens
        (recomputing any cached ones among them) and takes the positions before from its cached prefix, left-padded
        with zeros that the attention mask hides. Positions come from the mask, as without a cache, so the keys
        cached with their rotary positions line up."""
        from transformers import DynamicCache

        if not self.cache.max_tokens:
            return None
        found = [self.cache.longest(r.prompt_ids) for r in batch]
        if not any(layers for _, layers in found):
            return None
        fresh = max(len(r.prompt_ids) - length for r, (length, _) in zip(batch, found))
        cached = width - fresh
        if cached <= 0:
            return None
        reference = next(layers for _, layers in found if layers)
        merged = []
        for index, (key, value) in enumerate(reference):
            keys = key.new_zeros(len(batch), key.shape[0], cached, key.shape[-1])
            values = value.new_zeros(len(batch), value.shape[0], cached, value.shape[-1])
            for row, (request, (_, layers)) in enumerate(zip(batch, found)):
                take = len(request.prompt_ids) - fresh  # this row's tokens before the fed ones, all cached
                if take > 0:
                    keys[row, :, cached - take:] = layers[index][0][:, :take]
                    values[row, :, cached - take:] = layers[index][1][:, :take]
            merged.append((keys, values))
        return DynamicCache(merged)


class TemplateCodec:
    """Chat-template codec: each new message's tokens are the suffix the template adds to the previous chat."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    async def start(self, messages: list[dict[str, str]]) -> list[int]:
        return self._render(messages, True)

    async def add_assistant(self, transcript: Transcript, token_ids: list[int], log_probs: list[float]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        transcript.token_ids += token_ids
        transcript.response_mask += [1] * len(token_ids)
        transcript.response_logprobs += list(log_probs)
        transcript.messages.append({"role": "assistant", "content": text})
        return text

    async def add_user(self, transcript: Transcript, text: str) -> None:
        transcript.messages.append({"role": "user", "content": text})
        suffix = self._render(transcript.messages, True)[len(transcript.token_ids):]
        transcript.token_ids += suffix
        transcript.response_mask += [0] * len(suffix)
        transcript.response_logprobs += [0.0] * len(suffix)
