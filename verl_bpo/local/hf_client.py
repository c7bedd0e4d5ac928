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
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any

from verl_bpo.rollout.protocols import Transcript

__all__ = ["Generation", "BatchedHFClient", "TemplateCodec"]


@dataclasses.dataclass
class Generation:
    """What verl's server returns for one request: sampled token ids and their log-probabilities."""

    token_ids: list[int]
    log_probs: list[float]


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    future: asyncio.Future


class BatchedHFClient:
    """Samples turns from a local causal LM, batching concurrent requests.

    Args:
        model: a ``transformers`` causal LM (its weights may change between calls: training reuses it).
        tokenizer: its tokenizer (``pad_token_id`` and ``eos_token_id`` are used).
        temperature: sampling temperature (log-probs are of the tempered distribution, as the servers return).
        max_batch: most sequences in one ``generate`` call.
        gather_s: how long the first request of a batch waits for the rest of its wave.
    """

    def __init__(self, model: Any, tokenizer: Any, temperature: float = 1.0, max_batch: int = 64,
                 gather_s: float = 0.002) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.max_batch, self.gather_s = temperature, max_batch, gather_s
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id])
        self._pending: list[_Request] = []
        self._flusher: asyncio.Task | None = None
        self.calls = 0  # batched generate calls made (a measure of how well requests were gathered)

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> Generation:
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(prompt_ids), int(sampling_params.get("max_tokens", 16)), future))
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
        import torch

        self.calls += 1
        pad = self.tokenizer.pad_token_id
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, request in enumerate(batch):  # left padding: every prompt ends where generation starts
            ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
            attention[row, width - len(request.prompt_ids):] = 1
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=attention, do_sample=True, temperature=self.temperature,
                                      top_k=0, top_p=1.0, max_new_tokens=max(r.max_tokens for r in batch),
                                      output_scores=True, return_dict_in_generate=True, pad_token_id=pad)
        self.model.train(was_training)
        new = out.sequences[:, width:]
        log_probs = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # (batch, new, vocab)
        picked = log_probs.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        results = []
        for row, request in enumerate(batch):
            tokens = new[row, : request.max_tokens].tolist()
            end = next((i + 1 for i, t in enumerate(tokens) if t in self.eos_ids), len(tokens))
            results.append(Generation(tokens[:end], picked[row, :end].tolist()))
        return results


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
