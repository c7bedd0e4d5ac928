"""The BPO algorithm, independent of verl, torch and any sandbox: the ``bpo`` config (:mod:`.config`), tree math
(:mod:`.tree`), per-leaf metadata (:mod:`.leaf_meta`), the fork rule (:mod:`.fork_policy`) and the learned depth profile
the ``learned`` allocation reads (:mod:`.profile`)."""
