"""A tabular MDP with its exact policy gradient, served as a real sandbox and a tabular softmax policy, so that the
production path (sampler, agent loop, estimator, verl's loss) can be checked against the truth."""
