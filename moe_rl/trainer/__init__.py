"""The Megatron trainer: model, optimizer, train steps, dist checkpoints."""
