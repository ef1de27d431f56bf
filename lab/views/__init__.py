"""What a person sees or types: figures (plots/), report, widgets, baselines, runs, sweeps, CLI."""
