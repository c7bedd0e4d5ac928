"""verl plugin entry point (``[project.entry-points."verl.plugins"] bpo``).

verl imports every ``verl.plugins`` entry point on ``import verl``, in every process (driver, TaskRunner, workers),
so importing this module is what makes ``algorithm.adv_estimator=bpo`` resolvable everywhere. verl swallows plugin
import errors at DEBUG level; ``python -c "import verl_bpo.plugin"`` shows them.

The same hook registers the optional CPU platform (:mod:`verl_bpo.platforms.cpu`) when ``VERL_PLATFORM=cpu``;
without that variable nothing platform-related is imported.
"""

import os

from verl_bpo.integration import estimator  # noqa: F401  (registers "bpo" in verl's ADV_ESTIMATOR_REGISTRY)
from verl_bpo.integration.stock_launch import check_stock_launch

check_stock_launch()  # exits with the fix if verl's stock main_ppo was asked for adv_estimator=bpo

if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
    from verl_bpo.platforms import cpu  # noqa: F401  (registers verl's "cpu" platform + the gloo shim)
