"""verl plugin entry point (``[project.entry-points."verl.plugins"] bpo``).

verl imports every ``verl.plugins`` entry point on ``import verl``, in every process (driver, TaskRunner, workers),
so importing this module is what makes ``algorithm.adv_estimator=bpo`` resolvable everywhere. verl swallows plugin
import errors at DEBUG level; ``python -c "import verl_bpo.integration.plugin"`` shows them.

In a process running verl's stock ``python -m verl.trainer.main_ppo``, it also adds the hydra callback that turns
an ``algorithm.adv_estimator=bpo`` run into a BPO run and checks its settings before Ray starts
(:mod:`verl_bpo.integration.stock_launch`; ``VERL_BPO_STOCK_LAUNCH=0`` turns that off). In the Ray workers of
such a run (``VERL_BPO_TRAINER=1``) it registers BPOTrainer in verl's trainer registry and the FSDP engine that
reads packed tree rows (:mod:`verl_bpo.integration.packed_engine`). Other programs and the
workers of other runs are untouched.

The same hook registers the optional CPU platform (:mod:`verl_bpo.platforms.cpu`) when ``VERL_PLATFORM=cpu``;
without that variable nothing platform-related is imported.
"""

import logging
import os

from verl_bpo.integration import estimator  # noqa: F401  (registers "bpo" in verl's ADV_ESTIMATOR_REGISTRY)
from verl_bpo.integration.stock_launch import hook_stock_main_ppo, trainer_wanted

if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
    from verl_bpo.platforms import cpu  # noqa: F401  (registers verl's "cpu" platform + the gloo shim)

hook_stock_main_ppo()

if trainer_wanted():
    try:
        from verl_bpo.integration import trainer  # noqa: F401  (registers BPOTrainer as trainer_mode "bpo")
        from verl_bpo.integration.packed_engine import install as install_packed_engine

        install_packed_engine()  # actor workers train packed tree rows (bpo.packed); others pass through
    except Exception:  # verl would log this at DEBUG only and the run would stop at "Unknown trainer 'bpo'"
        logging.getLogger(__name__).exception("verl-bpo: cannot import the BPO trainer")
        raise
