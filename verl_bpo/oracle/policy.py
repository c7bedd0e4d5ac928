"""A tabular softmax policy served as an LLM client, and the one-token-per-turn chat codec it reads.

Token ids: ``0 .. A−1`` are the actions ``a0 .. a{A−1}``; ``A + t·X + x`` is the observation ``state t x``;
``UNKNOWN`` stands for any other text (a dead sandbox's note). A prompt is ``[BOS, state 0 0]``; a turn is one
action token (mask 1) followed, unless the episode ended, by one observation token (mask 0). So the state of
every generated token is the token just before it, and its log-probability under θ is exact:
``log softmax(θ[t, x])[a]``. Sampling is seeded and happens in call order, which asyncio keeps fixed.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np

from verl_bpo.oracle.mdp import TabularMDP, softmax_policy
from verl_bpo.oracle.sandbox import parse_state
from verl_bpo.rollout.protocols import Transcript

__all__ = ["Generation", "TabularPolicy", "TabularCodec"]


@dataclasses.dataclass
class Generation:
    """What verl's server returns for one request: sampled token ids and their log-probabilities."""

    token_ids: list[int]
    log_probs: list[float]


class TabularCodec:
    """Token layout of the module docstring; ``states`` and ``actions`` convert between tokens and (t, x) or a."""

    def __init__(self, mdp: TabularMDP) -> None:
        self.n_actions, self.n_outcomes = mdp.n_actions, mdp.n_outcomes
        self.bos = mdp.n_actions + mdp.horizon * mdp.n_outcomes + 1
        self.unknown = self.bos + 1

    def state_token(self, text: str) -> int:
        state = parse_state(text)
        return self.unknown if state is None else self.n_actions + state[0] * self.n_outcomes + state[1]

    def token_state(self, token: int) -> tuple[int, int]:
        """(t, x) of a state token (the BOS-preceded first state is a state token too)."""
        return divmod(token - self.n_actions, self.n_outcomes)

    async def start(self, messages: list[dict[str, str]]) -> list[int]:
        return [self.bos, self.state_token(messages[-1]["content"])]

    async def add_assistant(self, transcript: Transcript, token_ids: list[int], log_probs: list[float]) -> str:
        transcript.token_ids += token_ids
        transcript.response_mask += [1] * len(token_ids)
        transcript.response_logprobs += list(log_probs)
        text = f"a{token_ids[0]}" if token_ids and token_ids[0] < self.n_actions else ""
        transcript.messages.append({"role": "assistant", "content": text})
        return text

    async def add_user(self, transcript: Transcript, text: str) -> None:
        transcript.token_ids.append(self.state_token(text))
        transcript.response_mask.append(0)
        transcript.response_logprobs.append(0.0)
        transcript.messages.append({"role": "user", "content": text})


class TabularPolicy:
    """π_θ as an LLM client: one action token per turn, drawn from softmax(θ[t, x]) of the prompt's last state;
    it also returns the full next-token entropy, so the S1 score (``next_token_entropy``) runs on it."""

    def __init__(self, theta: np.ndarray, codec: TabularCodec, seed: int = 0) -> None:
        self.codec = codec
        pi = softmax_policy(theta)
        self.log_pi = np.log(pi).tolist()
        cdf = np.cumsum(pi, axis=-1)
        cdf[..., -1] = 1.0
        self.cdf = cdf.tolist()
        self.entropy = (-(pi * np.log(pi)).sum(axis=-1)).tolist()
        self.rng = random.Random(seed)
        self.calls = 0

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> Generation:
        self.calls += 1
        t, x = self.codec.token_state(prompt_ids[-1])
        u = self.rng.random()
        a = next(i for i, c in enumerate(self.cdf[t][x]) if u < c)
        return Generation([a], [self.log_pi[t][x][a]])

    async def next_token_entropy(self, prompt_ids: list[int]) -> float:
        """Entropy of π(· | t, x) at the history's last state: the S1 fork score, exact here."""
        t, x = self.codec.token_state(prompt_ids[-1])
        return self.entropy[t][x]
