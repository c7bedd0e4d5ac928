"""Optional hardware platforms for verl 0.9.1 (CI, laptops, the CPU demo); GPU users never load them.

* :mod:`verl_bpo.platforms.cpu` — a ``cpu`` platform for verl's registry plus the torch.distributed shim.
  Imported by :mod:`verl_bpo.integration.plugin` in every process; registers nothing unless ``VERL_PLATFORM=cpu``.
* :mod:`verl_bpo.platforms.vllm_cpu` — the ``vllm.general_plugins`` hook that keeps vLLM-CPU's linear weights
  live so verl's weight sync works; a no-op unless ``VERL_PLATFORM=cpu`` and vLLM runs on its CPU platform.
* :mod:`verl_bpo.platforms.cpu_launch` — hydra overrides, environment and a hang-proof runner for
  ``python -m verl.trainer.main_ppo`` (or ``verl_bpo.main``) on a CPU box.
* :mod:`verl_bpo.platforms.replay_poll` — verl's sync replay buffer polling every 0.1 s instead of 2 s (selected
  by ``cpu_launch.cpu_overrides`` through verl's custom-sampler hook).

This package module imports nothing, so that vLLM's plugin loader does not pay for ``import verl``.
"""

CPU_PLATFORM = "cpu"
