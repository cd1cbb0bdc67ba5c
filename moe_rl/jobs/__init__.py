"""Jobs that `moe-rl train` runs: one module each."""
