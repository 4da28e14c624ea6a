"""big_vit_lite: pretrain Vision Transformers with JAX/Flax at any scale."""

import setuptools

# Ranges, not pins: the lower bound of each is the version the test suite passes
# with (requirements/lock.txt pins that whole tree; CI installs it with `pip
# install -c`), upper bounds only where a release is known to break us. CI also
# installs the newest versions these ranges allow on a second Python and runs a
# smoke check (.ci/run).
INSTALL_REQUIRES = [
    # jax 0.10 is the last release for Python 3.11; 0.11+ need 3.12. 0.12.0.1 is
    # the newest checked (scripts/wheel_smoke.sh trains demo:runlocal with it on
    # Python 3.12).
    "jax>=0.10.2,<0.13",
    "jaxlib>=0.10.2,<0.13",
    "flax>=0.12.8",
    "optax>=0.2.8",
    # tf.data only: the CPU build is enough beside a GPU/TPU jax
    "tensorflow-cpu>=2.21.0",
    "tensorflow-datasets>=4.9.10",
    "importlib_resources>=7.1.0",  # tfds download_and_prepare needs it
    "ml_collections>=1.1.0",
    "orbax-checkpoint>=0.12.8",
    "clu>=0.0.12",
    "tensorboard>=2.21.0",
    "etils[epath]>=1.15.0",  # paths.py: workdirs on buckets (gs://)
    "safetensors>=0.8.0",  # timm export (numpy API, no torch)
    "absl-py>=2.5.1",
    "numpy>=2.4.6",
    # image folders (BMP/WebP/GIF decoding), ImageNet-21k builder
    "pillow>=13.0.0",
]

REPORT = ["matplotlib>=3.11.2"]
WANDB = ["wandb>=0.31.0,<0.32"]  # config.wandb (wandb_writer.py)
# Workdirs on gs://: orbax asks google-cloud-storage whether the bucket has a
# hierarchical namespace before it lists checkpoints (ImportError without it).
GCS = ["google-cloud-storage>=3.17.1,<4"]
TPU = ["jax[tpu]>=0.10.2,<0.13"] + GCS

EXTRAS = {
    # jax's own CUDA wheels (CUDA, cuDNN and NCCL come as pip packages; only the
    # NVIDIA driver is needed on the host): cuda = CUDA 12 (driver >= 525),
    # cuda13 = CUDA 13 (driver >= 580).
    "cuda": ["jax[cuda12]>=0.10.2,<0.13"],
    "cuda13": ["jax[cuda13]>=0.10.2,<0.13"],
    # libtpu (the TPU runtime and compiler; jax[tpu] pins the one matching jax):
    # for Cloud TPU VMs, and on any CPU machine for `plan --topology=SLICE
    # --compile` (the TPU compiler).
    "tpu": TPU,
    # XLA's GPU compiler without the NVIDIA wheels (~480 MB): `plan --gpu=HOST
    # --compile` on any CPU machine (docs/gpu.md). cuDNN attention needs the
    # cuDNN library too: the cuda extra (5.6 GB).
    "gpu-compile": ["jax[cuda12-local]>=0.10.2,<0.13"],
    "gcs": GCS,
    "report": REPORT,
    "wandb": WANDB,
    # TPU: tests/test_tpu_compile.py compiles for a TPU slice on the CPU.
    "test": (
        [
            "pytest>=9.2.0",
            "pytest-timeout>=2.4.0",
            "pytest-xdist>=3.8.0",
            "scikit-learn>=1.9.1",
            "build>=1.6.1",
            # tests/test_format.py: the code is pyink-formatted (pyproject.toml).
            "pyink>=26.5.1",
            # Mutation testing: python scripts/mutate.py MODULE (docs/testing.md).
            "mutmut>=3.8.1",
        ]
        + REPORT
        + WANDB
        + TPU
    ),
}

with open("README.md", encoding="utf-8") as f:
  LONG_DESCRIPTION = f.read()

setuptools.setup(
    name="big_vit_lite",
    version="0.1.0",
    description="Pretrain Vision Transformers with JAX/Flax, from one CPU to a TPU pod.",
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    # The configs live at the top of the repository (configs/) and ship inside
    # the package as big_vit_lite.configs, so `--config=vit_l16` finds them
    # after a pip install.
    packages=setuptools.find_packages(
        include=["big_vit_lite", "big_vit_lite.*"]
    )
    + ["big_vit_lite.configs"],
    package_dir={"big_vit_lite.configs": "configs"},
    # jax 0.10 has wheels for 3.11-3.13; tensorflow-cpu 2.21 has none for 3.14
    # yet.
    python_requires=">=3.11,<3.14",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
