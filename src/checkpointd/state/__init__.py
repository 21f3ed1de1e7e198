"""Live objects and the trees they are stored as: stateful kinds, what can be stored,
fit checks, optimizer state by parameter name, DTensor shards, RNG, training progress,
and the one tree walker."""
