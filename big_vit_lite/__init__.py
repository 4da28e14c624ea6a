"""big_vit_lite: pretrain Vision Transformers with JAX/Flax at any scale."""
__version__ = "0.1.0"
