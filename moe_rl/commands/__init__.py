"""One module per `moe-rl` command; see `moe_rl.cli`."""
