"""RL math as pure tensor functions: advantages, losses, KL control, loss aggregation."""
