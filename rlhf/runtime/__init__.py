"""What runs under every step: ranks and collectives, DeepSpeed engines, checkpoints with their
manifests and resume, the run dir's lock, and crash-safe file writes."""
