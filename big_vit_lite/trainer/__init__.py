"""The trainer's stages: config read, state and step assembled, the loop, checkpoints and resume."""
