"""big_vit_lite: pretrain Vision Transformers with JAX/Flax at any scale."""
import setuptools

# Versions pinned together: this set installs and passes the test suite on
# Python 3.11 (CPU). Bump them together, never one at a time.
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "tensorflow-cpu==2.21.0",
    "tensorflow-datasets==4.9.10",
    "importlib_resources==7.1.0",  # tfds download_and_prepare needs it
    "ml_collections==1.1.0",
    "orbax-checkpoint==0.12.8",
    "clu==0.0.12",
    "tensorboard==2.21.0",
    "etils[epath]==1.15.0",  # paths.py: workdirs on buckets (gs://)
    "safetensors==0.8.0",  # timm export (numpy API, no torch)
    "absl-py==2.5.1",
    "numpy==2.4.6",
    "pillow==13.0.0",  # image folders (BMP/WebP/GIF decoding), ImageNet-21k builder
]

setuptools.setup(
    name="big_vit_lite",
    version="0.1.0",
    description="Pretrain Vision Transformers with JAX/Flax, from one CPU to a TPU pod.",
    packages=setuptools.find_packages(include=["big_vit_lite", "big_vit_lite.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "test": ["pytest==9.2.0", "pytest-timeout==2.4.0", "pytest-xdist==3.8.0", "scikit-learn==1.9.1"],
    },
)
