"""verl's sync replay buffer, polling TransferQueue every 0.1 s instead of every 2 s.

verl's ``ReplayBuffer.sample`` waits for a step's rollouts by sleeping ``poll_interval`` (2 s, not configurable)
between checks, so a step's ``gen`` time is a multiple of 2 s. That is nothing next to a GPU run's rollouts and
most of a CPU run's: on the CPU demo's tiny model the rollouts of a step finish in well under 2 s. Selected with
verl's own hook for samplers (``trainer.v1.sampler.custom_sampler``, set by
:func:`verl_bpo.platforms.cpu_launch.cpu_overrides`); the sampling itself is verl's, unchanged.
"""

from __future__ import annotations

from typing import Any

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

__all__ = ["QuickPollReplayBuffer", "POLL_INTERVAL_S"]

POLL_INTERVAL_S = 0.1


class QuickPollReplayBuffer(ReplayBuffer):
    """:class:`ReplayBuffer` with ``poll_interval = 0.1`` s (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("poll_interval", POLL_INTERVAL_S)
        super().__init__(**kwargs)
