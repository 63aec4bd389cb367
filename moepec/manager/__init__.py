"""The one object a training loop talks to: CheckpointConfig, CheckpointManager."""
