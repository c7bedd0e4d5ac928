"""Branching Policy Optimization (BPO) for verl.

Layers, lowest first (``lint-imports`` enforces that no layer imports one above it):

* :mod:`verl_bpo.core` — the algorithm: the ``bpo`` config, tree math, per-leaf metadata, the fork rule. numpy only.
* :mod:`verl_bpo.rollout` — the tree sampler: grows one tree per task against a sandbox and an LLM client.
* :mod:`verl_bpo.data`, :mod:`verl_bpo.platforms` — verl-format datasets; the optional CPU platform.
* :mod:`verl_bpo.integration` — verl glue: estimator, agent loop, trainer, entry points, hydra config.
* :mod:`verl_bpo.oracle`, :mod:`verl_bpo.local` — a tabular MDP with its exact gradient (the tests' oracle);
  an in-process rollout and trainer for many-seed benchmarks.
* :mod:`verl_bpo.demo` — the CPU demo (``python -m verl_bpo.demo``).
"""
