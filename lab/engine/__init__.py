"""Real engines and trainers: dumps, scenarios, rule search, FSDP2 launches, sharded pairing."""
