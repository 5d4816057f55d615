"""Single-process torch code (never torch.distributed): attention backends, models, replay store."""
