"""Clearly named fakes for sampler tests: a scripted LLM, a word-level chat codec, and faulty sandboxes.

The sandboxes they wrap are real adapters (the smoke corridor); only the model and the tokenizer are faked here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time

from sandbox_adapters.base import RestoreFailed, SandboxCrashed
from sandbox_adapters.smoke import ACTIONS, SmokeSandbox
from verl_bpo.rollout.protocols import Transcript

WORDS = ["<unk>", "<eos>", *sorted({w for a in ACTIONS for w in a.split()})]
WORD_ID = {w: i for i, w in enumerate(WORDS)}


@dataclasses.dataclass
class Generation:
    token_ids: list[int]
    log_probs: list[float]


class ScriptedLLM:
    """Fake LLM: samples one smoke action per call from fixed probabilities (seeded), with honest log-probs."""

    def __init__(self, seed: int = 0, probs: dict[str, float] | None = None, delay_s: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.probs = probs or {"east": 0.4, "west": 0.2, "take key": 0.2, "open door": 0.2}
        self.request_ids: list[str] = []
        self.prompt_lengths: list[int] = []
        self.delay_s = delay_s

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.record(request_id, prompt_ids)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return self.sample(self.rng, sampling_params)

    def record(self, request_id, prompt_ids) -> None:
        """What the tests read of every request: its id and its prompt's length."""
        self.request_ids.append(request_id)
        self.prompt_lengths.append(len(prompt_ids))

    def sample(self, rng: random.Random, sampling_params) -> Generation:
        actions, weights = zip(*self.probs.items())
        action = rng.choices(actions, weights)[0]
        ids = [WORD_ID[w] for w in action.split()] + [WORD_ID["<eos>"]]
        per_token = math.log(self.probs[action]) / len(ids)
        ids = ids[: sampling_params.get("max_tokens", len(ids))]
        return Generation(ids, [per_token] * len(ids))


class SeededLLM(ScriptedLLM):
    """Fake LLM that honors a per-request ``seed`` in its sampling parameters, as vLLM does: a turn's sample is a
    function of its seed alone, whichever requests came before it. Each answer takes a random 0-2 ms, drawn from
    ``jitter``, so concurrent requests come back in another order on every run."""

    jitter = random.Random(0)

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.record(request_id, prompt_ids)
        await asyncio.sleep(self.jitter.uniform(0.0, 0.002))
        return self.sample(random.Random(sampling_params["seed"]), sampling_params)


class WordCodec:
    """Fake tokenizer: one token per known word, <unk> for the rest; env text gets mask 0."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return [WORD_ID.get(w, 0) for w in text.split()]

    async def start(self, messages):
        return [t for m in messages for t in self.encode(m["content"])]

    async def add_assistant(self, transcript: Transcript, token_ids, log_probs):
        transcript.token_ids += token_ids
        transcript.response_mask += [1] * len(token_ids)
        transcript.response_logprobs += list(log_probs)
        text = " ".join(WORDS[t] for t in token_ids if WORDS[t] != "<eos>")
        transcript.messages.append({"role": "assistant", "content": text})
        return text

    async def add_user(self, transcript: Transcript, text: str):
        ids = self.encode(text) or [0]
        transcript.token_ids += ids
        transcript.response_mask += [0] * len(ids)
        transcript.response_logprobs += [0.0] * len(ids)
        transcript.messages.append({"role": "user", "content": text})


class CountingSmoke(SmokeSandbox):
    """The real smoke corridor, counting live instances so tests can check every sandbox gets closed."""

    live = 0

    def __init__(self, config=None):
        super().__init__(config)
        CountingSmoke.live += 1
        self._closed = False

    def close(self):
        if not self._closed:
            self._closed = True
            CountingSmoke.live -= 1


class CrashingSmoke(CountingSmoke):
    """Fault injection: every step after the first raises with probability ``crash_prob``."""

    crash_prob = 0.3
    rng = random.Random(0)

    def _apply(self, action):
        if len(self.actions) >= 1 and self.rng.random() < self.crash_prob:
            raise SandboxCrashed("injected crash")
        return super()._apply(action)


class HangingSmoke(CountingSmoke):
    """Fault injection: the third step hangs far past the sampler's timeout."""

    blocking = True  # it sleeps: it must run on a worker thread, where the time limit applies

    def _apply(self, action):
        if len(self.actions) == 2:
            time.sleep(2.0)
        return super()._apply(action)


class SlowSnapshotSmoke(CountingSmoke):
    """A snapshot that takes 10 ms on a worker thread, as real engines' do: other branches decide meanwhile."""

    blocking = True

    def snapshot(self):
        time.sleep(0.01)
        return super().snapshot()


class JitterySmoke(CountingSmoke):
    """A step that takes 0-5 ms on a worker thread, drawn from ``rng``: as with real engines, the order in which a
    tree's branches reach their nodes changes from run to run."""

    blocking = True
    rng = random.Random(0)

    def step(self, action_text):
        time.sleep(self.rng.uniform(0.0, 0.005))
        return super().step(action_text)


class UnrestorableSmoke(CountingSmoke):
    """Fault injection: every other restore fails."""

    calls = 0

    def restore(self, snapshot, seed=None):
        UnrestorableSmoke.calls += 1
        if UnrestorableSmoke.calls % 2 == 0:
            raise RestoreFailed("injected restore failure")
        super().restore(snapshot, seed)


class UnstartableSmoke(CountingSmoke):
    """Fault injection: the first ``failures`` resets (counted across instances) raise."""

    failures = 1
    resets = 0

    def reset(self, task):
        UnstartableSmoke.resets += 1
        if UnstartableSmoke.resets <= UnstartableSmoke.failures:
            raise SandboxCrashed("injected reset failure")
        return super().reset(task)
