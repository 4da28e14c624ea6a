"""ViT sizes by name: width, depth, MLP size and heads, and "B/16"-style variant names."""

# Widths, depths, MLP sizes and heads of the literature: ViT paper (Ti..H),
# "Scaling Vision Transformers" (g, G), "How to train your ViT" (M, mu) and
# "Getting ViT in shape" (So400m).
VARIANTS = {
    #          width depth  mlp  heads
    "mu": (32, 1, 128, 2),
    "Ti": (192, 12, 768, 3),
    "S": (384, 12, 1536, 6),
    "M": (512, 12, 2048, 8),
    "B": (768, 12, 3072, 12),
    "L": (1024, 24, 4096, 16),
    "So400m": (1152, 27, 4304, 16),
    "H": (1280, 32, 5120, 16),
    "g": (1408, 40, 6144, 16),
    "G": (1664, 48, 8192, 16),
}


def size_name(width, depth, mlp_dim, heads=None):
  """The literature's size ("B", ...) of this width, depth, MLP size (and heads), or None."""
  return next(
      (
          n
          for n, (w, d, m, h) in VARIANTS.items()
          if (w, d, m) == (width, depth, mlp_dim) and heads in (None, h)
      ),
      None,
  )


def decode_variant(variant: str) -> dict:
  """ "B/16" -> dict(width=768, depth=12, mlp_dim=3072, num_heads=12, patch_size=16)."""
  size, sep, patch = variant.partition("/")
  if not sep or size not in VARIANTS or not patch.isdigit() or int(patch) < 1:
    raise ValueError(
        f"Unknown ViT variant {variant!r}: use '{{size}}/{{patch}}' with size one of "
        f"{', '.join(VARIANTS)} and an integer patch size, e.g. 'B/16'."
    )
  width, depth, mlp_dim, num_heads = VARIANTS[size]
  return dict(
      width=width,
      depth=depth,
      mlp_dim=mlp_dim,
      num_heads=num_heads,
      patch_size=int(patch),
  )
