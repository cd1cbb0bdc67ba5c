"""Checkpoint conversion through the bridges (`moe-rl convert`), and the converted checkpoints.

- `moe_rl.conversion.directory`: the converted-checkpoint directory (layout, meta, loading it);
- `moe_rl.conversion.checks`: what is refused before any rank starts (outputs, layouts);
- `moe_rl.conversion.ranks`: the rank functions, one per direction.
"""
