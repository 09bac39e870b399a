"""What a run persists: the results folder, checkpoints, client state, lifetime budgets, the per-machine cache."""
