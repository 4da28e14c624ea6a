"""RandAugment placeholder until the stateless implementation lands."""
