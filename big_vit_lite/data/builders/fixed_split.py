"""The fixed, seeded train/test split of datasets that ship without one.

Rule (documented in the README): group identical images (exact byte
duplicates, so copies never straddle the split), order the groups by a
numpy.random.default_rng(seed) permutation of the groups (groups numbered in
order of first appearance), then walk them: a group joins "test" while it
still fits in `num_test`, else "train". The result depends on the data and
the seed only, and "test" has exactly `num_test` examples whenever single
images are left to fill it (always the case here).
"""
import numpy as np

SPLIT_SEED = 0


def split_indices(images, num_test, seed=SPLIT_SEED):
  """images: [N, ...] uint8 -> (train_indices, test_indices), each sorted."""
  groups = {}
  for i, img in enumerate(images):
    groups.setdefault(np.ascontiguousarray(img).tobytes(), []).append(i)
  members = list(groups.values())
  order = np.random.default_rng(seed).permutation(len(members))
  train, test = [], []
  for g in order:
    group = members[g]
    (test if len(test) + len(group) <= num_test else train).extend(group)
  return sorted(train), sorted(test)
