"""Evaluation data on disk: a folder of images with masks, or a JSONL file of texts with rationales.

Image folder (:class:`ImageMaskFolder`)::

    root/images/<name>.png|jpg|jpeg     the images (RGB; other modes are converted)
    root/masks/<name>.png               optional: the object mask of each image, same stem, PNG;
                                        any nonzero value is foreground
    root/labels.csv                     optional: a header line, then "<image file name>,<class index>"

Images are resized (bilinearly) to the model's input size, scaled to [0, 1] and normalized with the
given ``(mean, std)``; masks are resized with nearest-neighbour interpolation. Without masks only the
perturbation tests apply; without labels the target is the predicted class.

Text file (:class:`RationaleJSONL`), one JSON object per line::

    {"text": "a fine film", "label": 1, "rationale": ["fine"]}
    {"text": "a dull one",  "label": 0, "rationale": [[2, 6]]}

``label`` (optional) is a class index. ``rationale`` (optional) is a list whose entries are either
``[start, end]`` character spans of ``text`` (end exclusive; or ``{"start": s, "end": e}``), or strings:
every whole-word, case-insensitive occurrence of the string in the text is rationale. A token belongs
to the rationale when its character span (from a fast tokenizer's offset mapping) overlaps a
rationale span; special tokens and padding never do. Each batch is padded to its own longest text
(at most ``max_length`` tokens): one captured graph serves every length.

Both yield batches as dicts: ``inputs`` (what the model's forward takes), ``labels`` ([batch] long or
None), ``masks`` ([batch, H, W] bool or None) or ``rationales`` ([batch, positions] bool) and
``special_tokens_mask``, and ``names`` / ``texts``.
"""
from __future__ import annotations

import csv
import json
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import InputError
from ..api.raw_inputs import model_image_size  # noqa: F401  (re-exported: relprop.evaluation.model_image_size)
from . import _util

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")



def model_normalization(model: torch.nn.Module) -> Optional[Tuple[Tuple[float, ...], Tuple[float, ...]]]:
    """The (mean, std) a model's images are normalized with: a timm model's ``pretrained_cfg``, or
    the image processor saved next to a HuggingFace model loaded from a local folder; None if unknown."""
    if isinstance(getattr(model, "pretrained_cfg", None), dict) and "mean" in model.pretrained_cfg:
        return _util.resolve_normalization(model.pretrained_cfg)
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if path and os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        with open(os.path.join(path, "preprocessor_config.json")) as f:
            cfg = json.load(f)
        if cfg.get("image_mean") is not None and cfg.get("image_std") is not None:
            if cfg.get("do_normalize", True):
                return _util.resolve_normalization(cfg)
    return None


class ImageMaskFolder:
    """Images with optional object masks and labels (layout in the module docstring).

    Parameters
    ----------
    root : the folder holding ``images/`` (and ``masks/``, ``labels.csv``).
    image_size : (H, W) or an int to resize every image to; None keeps each image's size (they must
        then all have the same size to be batched).
    normalization : the model's ``(mean, std)`` (or anything :func:`resolve_normalization` reads);
        None: pixels stay in [0, 1].
    limit : use only the first ``limit`` images (sorted by name).
    """

    modality = "vision"

    def __init__(self, root: str, image_size: Any = None, normalization: Any = None, limit: Optional[int] = None):
        self.root = root
        images_dir = os.path.join(root, "images")
        if not os.path.isdir(images_dir):
            raise InputError(f"{root} has no images/ folder (expected images/*.png|jpg and masks/<same name>.png)")
        names = sorted(n for n in os.listdir(images_dir) if n.lower().endswith(IMAGE_EXTENSIONS))
        if not names:
            raise InputError(f"{images_dir} holds no .png/.jpg/.jpeg image")
        self.names = names[:limit] if limit else names
        masks_dir = os.path.join(root, "masks")
        self.has_masks = os.path.isdir(masks_dir)
        if self.has_masks:
            missing = [n for n in self.names if not os.path.isfile(self._mask_path(n))]
            if missing:
                raise InputError(f"{masks_dir} has no mask for {missing[:5]} (expected masks/<image stem>.png)")
        self.labels = self._read_labels(os.path.join(root, "labels.csv"))
        self.image_size = (image_size, image_size) if isinstance(image_size, int) else (
            tuple(image_size) if image_size is not None else None)
        self.normalization = _util.resolve_normalization(normalization)

    def _mask_path(self, name: str) -> str:
        return os.path.join(self.root, "masks", os.path.splitext(name)[0] + ".png")

    def _read_labels(self, path: str) -> Optional[Dict[str, int]]:
        if not os.path.isfile(path):
            return None
        labels = {}
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        for row in rows[1:]:
            if len(row) >= 2 and row[0].strip():
                name, label = row[0].strip(), int(row[1])
                labels[name] = label
                labels[os.path.splitext(name)[0]] = label
        missing = [n for n in self.names if n not in labels]
        if missing:
            raise InputError(f"{path} has no label for {missing[:5]}")
        return labels

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        from PIL import Image
        name = self.names[i]
        with Image.open(os.path.join(self.root, "images", name)) as im:
            im = im.convert("RGB")
            if self.image_size is not None and im.size != (self.image_size[1], self.image_size[0]):
                im = im.resize((self.image_size[1], self.image_size[0]), Image.BILINEAR)
            x = torch.from_numpy(np.asarray(im, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
        if self.normalization is not None:
            mean, std = self.normalization
            x = (x - torch.tensor(mean).view(-1, 1, 1)) / torch.tensor(std).view(-1, 1, 1)
        mask = None
        if self.has_masks:
            with Image.open(self._mask_path(name)) as m:
                m = m.convert("L")
                if m.size != (x.shape[2], x.shape[1]):
                    m = m.resize((x.shape[2], x.shape[1]), Image.NEAREST)
                mask = torch.from_numpy(np.asarray(m) > 0)
        label = self.labels[name] if self.labels is not None else None
        return {"name": name, "pixel_values": x, "mask": mask, "label": label}

    def batches(self, batch_size: int = 8) -> Iterator[Dict[str, Any]]:
        """Batches of ``batch_size`` images (the last may be smaller)."""
        for start in range(0, len(self), batch_size):
            items = [self[i] for i in range(start, min(start + batch_size, len(self)))]
            yield {"inputs": torch.stack([it["pixel_values"] for it in items]),
                   "masks": torch.stack([it["mask"] for it in items]) if self.has_masks else None,
                   "labels": torch.tensor([it["label"] for it in items]) if self.labels is not None else None,
                   "names": [it["name"] for it in items]}


def rationale_spans(text: str, rationale: Sequence[Any]) -> List[Tuple[int, int]]:
    """Character spans [start, end) of a rationale given as spans and/or strings (see module docstring)."""
    spans = []
    for r in rationale or []:
        if isinstance(r, str):
            if not r.strip():
                continue
            pattern = r"(?<!\w)" + re.escape(r.strip()) + r"(?!\w)"
            spans += [(m.start(), m.end()) for m in re.finditer(pattern, text, flags=re.IGNORECASE)]
        elif isinstance(r, dict) and "start" in r and "end" in r:
            spans.append((int(r["start"]), int(r["end"])))
        elif isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(v, int) for v in r):
            spans.append((int(r[0]), int(r[1])))
        else:
            raise InputError(f"rationale entry {r!r}: expected a string or a [start, end] character span")
    for a, b in spans:
        if not 0 <= a < b <= len(text):
            raise InputError(f"rationale span [{a}, {b}) is not inside the text of {len(text)} characters")
    return spans


class RationaleJSONL:
    """Texts with labels and human rationales, one JSON object per line (format in the module docstring).

    Parameters
    ----------
    path : the .jsonl file.
    tokenizer : a *fast* HuggingFace tokenizer (it gives character offsets), or a name/path for
        ``AutoTokenizer.from_pretrained``.
    max_length : longest tokenized text kept (longer ones are truncated).
    limit : use only the first ``limit`` lines.
    """

    modality = "text"
    normalization = None

    def __init__(self, path: str, tokenizer: Any, max_length: int = 512, limit: Optional[int] = None):
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if not getattr(tokenizer, "is_fast", False):
            raise InputError("RationaleJSONL needs a fast tokenizer (offset mappings): use AutoTokenizer, "
                             "or PreTrainedTokenizerFast, not a slow tokenizer class")
        self.path, self.tokenizer = path, tokenizer
        records = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}:{n}: not JSON ({e})") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                    raise InputError(f"{path}:{n}: expected an object with a \"text\" string")
                records.append(rec)
                if limit and len(records) >= limit:
                    break
        if not records:
            raise InputError(f"{path} holds no text")
        self.texts = [r["text"] for r in records]
        has_label = ["label" in r and r["label"] is not None for r in records]
        if any(has_label) and not all(has_label):
            raise InputError(f"{path}: some lines have a label and some do not")
        self.labels = torch.tensor([int(r["label"]) for r in records]) if all(has_label) else None
        self.has_rationales = any(r.get("rationale") for r in records)
        spans = [rationale_spans(r["text"], r.get("rationale")) for r in records]
        enc = tokenizer(self.texts, padding="longest", truncation=True, max_length=max_length,
                        return_offsets_mapping=True, return_special_tokens_mask=True, return_tensors="pt")
        offsets = enc.pop("offset_mapping")
        special = enc.pop("special_tokens_mask").bool()
        self.inputs = {k: v for k, v in enc.items()}
        am = self.inputs.get("attention_mask", torch.ones_like(self.inputs["input_ids"])).bool()
        self.special_tokens_mask = special | ~am
        rat = torch.zeros_like(special)
        for i, sp in enumerate(spans):
            s, e = offsets[i, :, 0], offsets[i, :, 1]
            for a, b in sp:
                rat[i] |= (s < b) & (e > a) & (e > s)
        self.rationales = rat & ~self.special_tokens_mask

    def __len__(self) -> int:
        return len(self.texts)

    def batches(self, batch_size: int = 8) -> Iterator[Dict[str, Any]]:
        """Batches of ``batch_size`` texts (the last may be smaller), each padded to its longest text."""
        am = self.inputs.get("attention_mask", torch.ones_like(self.inputs["input_ids"])).bool()
        for start in range(0, len(self), batch_size):
            sl = slice(start, min(start + batch_size, len(self)))
            used = am[sl].any(0).nonzero().flatten()  # the positions some text of the batch fills
            cols = slice(int(used[0]), int(used[-1]) + 1) if used.numel() else slice(None)
            yield {"inputs": {k: v[sl, cols] for k, v in self.inputs.items()},
                   "labels": self.labels[sl] if self.labels is not None else None,
                   "rationales": self.rationales[sl, cols] if self.has_rationales else None,
                   "special_tokens_mask": self.special_tokens_mask[sl, cols],
                   "texts": self.texts[sl]}


def load_dataset(path: str, *, tokenizer: Any = None, image_size: Any = None, normalization: Any = None,
                 max_length: int = 512, limit: Optional[int] = None):
    """A folder -> ``ImageMaskFolder``; a ``.jsonl`` file -> ``RationaleJSONL``."""
    if os.path.isdir(path):
        return ImageMaskFolder(path, image_size=image_size, normalization=normalization, limit=limit)
    if os.path.isfile(path) and path.lower().endswith((".jsonl", ".json")):
        if tokenizer is None:
            raise InputError(f"{path} holds texts: a tokenizer is needed")
        return RationaleJSONL(path, tokenizer, max_length=max_length, limit=limit)
    raise InputError(f"{path} is neither a folder of images (images/, masks/) nor a .jsonl file of texts")
