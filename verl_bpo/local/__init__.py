"""In-process rollout (a batching Hugging Face client and a chat-template codec) and a one-process policy-gradient
loop with verl's estimators and loss, for benchmarks that need many seeds on one machine."""
