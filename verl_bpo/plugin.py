"""verl plugin entry point (``[project.entry-points."verl.plugins"] bpo``).

verl imports every ``verl.plugins`` entry point on ``import verl``, in every process (driver, TaskRunner, workers),
so importing this module is what makes ``algorithm.adv_estimator=bpo`` resolvable everywhere. verl swallows plugin
import errors at DEBUG level; ``python -c "import verl_bpo.plugin"`` shows them.
"""

from verl_bpo import estimator  # noqa: F401  (registers "bpo" in verl's ADV_ESTIMATOR_REGISTRY)
