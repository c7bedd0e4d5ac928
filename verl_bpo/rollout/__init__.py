"""Growing trees: :class:`~verl_bpo.rollout.sampler.TreeSampler` and its parts (protocols, sandbox calls, tree
state, fork scores, metrics). No verl, no torch: any LLM client and chat codec that meet the protocols work."""
