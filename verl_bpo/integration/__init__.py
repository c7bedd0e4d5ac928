"""verl glue, kept thin: the registered ``bpo`` estimator, the ``bpo_tree`` agent loop, the trainer that hands the
tree metadata to the estimator, the hydra entry point, the ``verl.plugins`` hook and the ``bpo`` config schema."""
