"""Warm-start a tiny model so it speaks a sandbox's action format (the SFT stage before RL).

A randomly initialised tiny model almost never writes a valid action, so every rollout earns the same reward and
RL has nothing to compare. Before the CPU demo and the end-to-end tests train with RL, this module fine-tunes the
tiny model (supervised, a few hundred steps on CPU) on transcripts of a **uniformly random** policy over the
sandbox's admissible actions: the model learns the chat format and the action vocabulary, not which action is good.
With ``expert_prob > 0`` a share of the turns imitate the sandbox's demonstrator instead (its ``demonstration(rng)``
when it has one — the signpost corridor's walks east and picks a door at random —, else its ``best_action()``),
like an SFT stage on noisy demonstrations: the model starts weak but not hopeless, and what it learns beyond that
comes from RL.

Input-embedding rows of tokens the chats never contain keep their random initialisation, and such a token as input
gives the next token's log-prob a gradient over 100 times a trained token's in norm (measured on the smoke
corridor: 1334 into the unseen row, against about 10): the policy samples one now and then (its byte tokens have
p ~ 1e-6, a batch samples thousands of tokens), and those draws dominated every gradient-variance measurement. As
transformers does for tokens it adds (``resize_token_embeddings(mean_resizing=True)``), the warm start gives those
rows the mean of the rows the chats trained.

    python -m verl_bpo.warm_start MODEL_DIR OUT_DIR --sandbox smoke --tasks 0-7
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sandbox_adapters.base import Observation, Sandbox
from sandbox_adapters.registry import make_sandbox
from verl_bpo.demo import tiny_model

__all__ = ["random_policy_chats", "play_chats", "warm_start"]

logger = logging.getLogger(__name__)
_STAMP = "warm_start.json"
# Bump when the chats, their tokenization or what is done to the model change: a cached warm start made by older
# code is then redone.
_WARM_START_VERSION = 3


def random_policy_chats(sandbox: str, sandbox_config: Mapping[str, Any] | None, tasks: Sequence[Mapping[str, Any]],
                        episodes: int, max_turns: int, seed: int = 0,
                        expert_prob: float = 0.0) -> list[list[dict[str, str]]]:
    """Chats (system, user, assistant, user, ...) of a policy that picks admissible actions uniformly at random, or,
    with probability ``expert_prob``, the sandbox's demonstrator (``demonstration(rng)``, else ``best_action()``)."""
    rng = random.Random(seed)
    box = make_sandbox(sandbox, sandbox_config)
    if hasattr(box, "demonstration"):
        demonstrate = lambda: box.demonstration(rng)  # noqa: E731
    elif hasattr(box, "best_action"):
        demonstrate = box.best_action
    elif expert_prob > 0:
        box.close()
        raise ValueError(f"warm start: expert_prob={expert_prob} needs a sandbox with best_action() or "
                         f"demonstration(); {sandbox!r} has neither, so use expert_prob=0")
    def policy(task: Mapping[str, Any]) -> Callable[[int, Observation], str]:
        def act(turn: int, obs: Observation) -> str:
            if rng.random() < expert_prob:
                return demonstrate()
            return rng.choice(list(obs.info["admissible_commands"]))
        return act

    return play_chats(box, tasks, episodes, max_turns, policy)


def play_chats(box: Sandbox, tasks: Sequence[Mapping[str, Any]], episodes: int, max_turns: int,
               policy: Callable[[Mapping[str, Any]], Callable[[int, Observation], str]]) -> list[list[dict[str, str]]]:
    """Chats of ``episodes`` episodes on ``tasks`` (in turn) in ``box``, closed at the end. ``policy(task)`` is
    called before each episode's reset and gives the episode's ``act(turn, observation) -> action``."""
    chats = []
    try:
        for i in range(episodes):
            task = tasks[i % len(tasks)]
            act = policy(task)
            obs = box.reset(task)
            chat = box.opening_chat(obs)
            for turn in range(max_turns):
                action = act(turn, obs)
                chat.append({"role": "assistant", "content": action})
                result = box.step(action)
                if result.done:
                    break
                obs = result.observation
                chat.append({"role": "user", "content": box.render_observation(obs)})
            chats.append(chat)
    finally:
        box.close()
    return chats


def _tokenize(tokenizer, chat: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of the whole chat and a mask that is 1 on assistant reply tokens (the end-of-turn token included)."""
    ids, mask = [], []
    for i in range(len(chat)):
        prefix = tokenizer.apply_chat_template(chat[: i + 1], tokenize=True, add_generation_prompt=False)
        prefix = list(prefix["input_ids"] if isinstance(prefix, Mapping) else prefix)
        new = prefix[len(ids):]
        if chat[i]["role"] == "assistant":
            header = tokenizer.apply_chat_template(chat[:i], tokenize=True, add_generation_prompt=True)
            header = list(header["input_ids"] if isinstance(header, Mapping) else header)
            n_header = len(header) - len(ids)
            mask += [0] * n_header + [1] * (len(new) - n_header)
        else:
            mask += [0] * len(new)
        ids = prefix
    return ids, mask


def _mean_fill_unseen_embeddings(model, seen: set[int]) -> None:
    """Input-embedding rows of tokens not in ``seen`` take the mean of the rows of those in it (module docstring)."""
    import torch

    weight = model.get_input_embeddings().weight
    unseen = torch.ones(weight.shape[0], dtype=torch.bool)
    unseen[sorted(seen)] = False
    with torch.no_grad():
        weight[unseen] = weight[~unseen].mean(0)


def warm_start(model_dir: str | Path, out_dir: str | Path, sandbox: str, tasks: Sequence[Mapping[str, Any]],
               sandbox_config: Mapping[str, Any] | None = None, episodes: int = 64, max_turns: int = 6,
               steps: int = 150, batch_size: int = 8, lr: float = 3e-3, seed: int = 0,
               expert_prob: float = 0.0, chats: Sequence[list[dict[str, str]]] | None = None,
               decay: bool = False) -> Path:
    """Fine-tune ``model_dir`` on random-policy chats into ``out_dir`` (skipped if already done identically);
    ``expert_prob`` mixes in the sandbox's ``best_action()`` (see :func:`random_policy_chats`). ``chats``: train on
    these chats instead (a caller's own demonstrator, e.g. :mod:`verl_bpo.demo.textworld_tasks`); ``episodes``,
    ``max_turns`` and ``expert_prob`` are then unused. ``decay``: the learning rate falls linearly from ``lr`` to 0
    over the steps, so the model ends where the average batch leads, not where the last few pushed it (at a constant
    rate, warm starts of one recipe on other draws ended anywhere from sound to dropping a word of the action)."""
    out = Path(out_dir)
    base_stamp = Path(model_dir) / tiny_model.STAMP  # a rebuilt base model (new tokenizer) redoes the warm start
    settings = {"version": _WARM_START_VERSION,
                "base": json.loads(base_stamp.read_text()) if base_stamp.is_file() else None,
                "model_dir": str(model_dir), "sandbox": sandbox, "config": dict(sandbox_config or {}),
                "tasks": [dict(t) for t in tasks], "episodes": episodes, "max_turns": max_turns, "steps": steps,
                "batch_size": batch_size, "lr": lr, "seed": seed, "expert_prob": expert_prob}
    if decay:  # only when set, so that the warm starts cached before the option stay valid
        settings["decay"] = True
    if chats is not None:  # the stamp names the given chats by their digest
        settings["chats_sha256"] = hashlib.sha256(json.dumps(list(chats), sort_keys=True).encode()).hexdigest()
    stamp = out / _STAMP
    if stamp.is_file() and json.loads(stamp.read_text()) == settings:
        return out

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if chats is None:
        chats = random_policy_chats(sandbox, sandbox_config, tasks, episodes, max_turns, seed, expert_prob)
    data = [_tokenize(tokenizer, chat) for chat in chats]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps if decay else 1.0)
    rng = random.Random(seed)
    pad = tokenizer.pad_token_id
    model.train()
    for step in range(steps):
        batch = [data[rng.randrange(len(data))] for _ in range(batch_size)]
        length = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, length), pad)
        labels = torch.full((batch_size, length), -100)
        attention = torch.zeros((batch_size, length), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.where(torch.tensor(mask) == 1, torch.tensor(ids), -100)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            logger.info("warm start step %d/%d: loss %.3f", step + 1, steps, loss.item())
    _mean_fill_unseen_embeddings(model, {token for ids, _ in data for token in ids})
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stamp.write_text(json.dumps(settings, indent=1))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--sandbox", default="smoke")
    parser.add_argument("--tasks", default="0-7", help="task ids, e.g. 0-7 (task = {'task_id': i})")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)
    lo, _, hi = args.tasks.partition("-")
    tasks = [{"task_id": i} for i in range(int(lo), int(hi or lo) + 1)]
    logging.basicConfig(level=logging.INFO)
    warm_start(args.model_dir, args.out_dir, args.sandbox, tasks, steps=args.steps)


if __name__ == "__main__":
    main()
