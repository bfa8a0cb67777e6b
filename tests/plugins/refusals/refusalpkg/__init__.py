"""A package whose attention module imports a fused kernel package this machine does not have."""
