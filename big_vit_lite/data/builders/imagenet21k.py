"""imagenet21k: ImageNet-21k (full ImageNet) from the official tar file(s).

tfds has no public builder for it. Prepare with
  python -m big_vit_lite.data.prepare imagenet21k[/CONFIG] --manual_dir=M [--data_dir=D]
where M holds any one of these layouts of the official release:
  * the whole-release archive as downloaded: fall11_whole.tar (one tar of
    per-synset tars) or winter21_whole.tar.gz (same, gzip'd), or several
    such archives (parts);
  * the per-synset tars themselves: M/n01440764.tar, ...;
  * extracted per-synset folders: M/n01440764/*.JPEG.
Configs (the class count is checked against the synsets found):
  fall11    (default) the 2011 release: 21,841 synsets, 14.2M images
  winter21  the 2021 release: 19,167 synsets, 13.2M images
  custom    any subset or re-packaging: classes = the synsets found
Labels are the sorted synset ids. One split, "full" (as big_vision); hold out
a minival with e.g. split="full[:51200]" and train on "full[51200:]" (tfds
shuffles examples at write time, so a slice is a random subset).
Listing the synsets of a .tar.gz needs one extra pass over it unless M also
holds synsets.txt (one synset id per line). Generation is single-process
(no Beam): expect hours for the full release.
"""

import dataclasses
import io
import logging
import os
import re
import tarfile

import tensorflow_datasets as tfds

from big_vit_lite.data import image_check

_SYNSET = re.compile(r"^(n\d{8})(\.tar)?$")

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Imagenet21kConfig(tfds.core.BuilderConfig):
  num_classes: int | None = None


def _synset_of(name):
  m = _SYNSET.match(os.path.basename(name.rstrip("/")))
  return m.group(1) if m else None


def _archives(manual_dir):
  return sorted(
      os.path.join(manual_dir, f)
      for f in os.listdir(manual_dir)
      if f.endswith((".tar", ".tar.gz", ".tgz")) and not _synset_of(f)
  )


def find_synsets(manual_dir):
  """Sorted synset ids in the manual dir (any supported layout)."""
  listed = os.path.join(manual_dir, "synsets.txt")
  if os.path.isfile(listed):
    with open(listed) as f:
      return sorted({line.strip() for line in f if line.strip()})
  found = {_synset_of(f) for f in os.listdir(manual_dir)} - {None}
  for archive in _archives(manual_dir):
    # reads headers only for plain .tar
    with tarfile.open(archive, "r:*") as tar:
      found |= {_synset_of(m.name) for m in tar.getmembers()} - {None}
  if not found:
    raise ValueError(
        f"no ImageNet-21k synsets (n########.tar / folders / whole-release "
        f"archives) in {manual_dir}"
    )
  return sorted(found)


def _images_in_tar(fileobj):
  with tarfile.open(fileobj=fileobj, mode="r|*") as inner:
    for m in inner:
      if m.isfile():
        yield os.path.basename(m.name), inner.extractfile(m).read()


def iter_images(manual_dir):
  """Yields (synset, file_name, bytes) over the whole manual dir."""
  for entry in sorted(os.listdir(manual_dir)):
    path, synset = os.path.join(manual_dir, entry), _synset_of(entry)
    if synset and os.path.isdir(path):
      for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
          yield synset, name, f.read()
    elif synset:
      with open(path, "rb") as f:
        for name, data in _images_in_tar(f):
          yield synset, name, data
  for archive in _archives(manual_dir):
    # streaming: works for .tar.gz too
    with tarfile.open(archive, "r|*") as outer:
      for m in outer:
        synset = _synset_of(m.name)
        if m.isfile() and synset:
          for name, data in _images_in_tar(outer.extractfile(m)):
            yield synset, name, data


class Imagenet21k(tfds.core.GeneratorBasedBuilder):
  """ImageNet-21k from the official tar files (manual download)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {
      "1.0.0": "Built by big_vit_lite from the official release tars."
  }
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__
  BUILDER_CONFIGS = [
      Imagenet21kConfig(
          name="fall11",
          num_classes=21_841,
          description="Fall 2011 release (fall11_whole.tar).",
      ),
      Imagenet21kConfig(
          name="winter21",
          num_classes=19_167,
          description="Winter 2021 release (winter21_whole.tar.gz).",
      ),
      Imagenet21kConfig(
          name="custom",
          num_classes=None,
          description="Any set of synset tars/folders; classes as found.",
      ),
  ]

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(encoding_format="jpeg"),
                "label": tfds.features.ClassLabel(
                    num_classes=self.builder_config.num_classes
                ),
                "file_name": tfds.features.Text(),
            }
        ),
        supervised_keys=("image", "label"),
        homepage="https://image-net.org/",
    )

  def _split_generators(self, dl_manager):
    manual_dir = str(dl_manager.manual_dir)
    synsets = find_synsets(manual_dir)
    want = self.builder_config.num_classes
    if want is not None and len(synsets) != want:
      raise ValueError(
          f"found {len(synsets)} synsets in {manual_dir} but config "
          f"{self.builder_config.name!r} has {want}; use imagenet21k/custom "
          f"for subsets or other releases"
      )
    self.info.features["label"].names = synsets
    return {"full": self._generate_examples(manual_dir, frozenset(synsets))}

  def _generate_examples(self, manual_dir, synsets):  # pylint: disable=arguments-differ
    skipped = 0
    for synset, name, data in iter_images(manual_dir):
      if synset not in synsets:
        continue
      problem = image_check.bytes_problem(data)
      # checked here: a bad image in the records would stop training
      if problem:
        skipped += 1
        log.warning("imagenet21k: skipping %s/%s (%s)", synset, name, problem)
        continue
      # Stored as downloaded (no re-encode); the pp decode ops read JPEG,
      # CMYK JPEG and PNG alike.
      yield f"{synset}/{name}", {
          "image": io.BytesIO(data),
          "label": synset,
          "file_name": name,
      }
    if skipped:
      log.warning("imagenet21k: skipped %d unreadable files in total", skipped)
