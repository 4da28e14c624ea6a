"""Config plumbing: the --config flag, unread keys, the knobs every training config has."""
