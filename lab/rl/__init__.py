"""Flow-GRPO SDE step and log-prob, trajectories, gradients, latent layout."""
