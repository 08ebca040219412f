"""Synthetic data with known ground truth for the faithfulness benchmark.

Text: sentences from a small template grammar. Each sentence holds 1-3 keywords of its class (the
rationale) inside neutral clauses, plus distractor words that occur equally often in every class.
"Mixed" sentences also hold keywords of a second class; the label follows the **majority rule**: the
class with more keywords wins (2 vs 1), so an explanation of the label should point at the
majority keywords and an explanation of the runner-up class at the minority ones.

Vision: 64x64 RGB images of 1 or 2 filled shapes (circle, square, triangle, cross; class = shape) of
random colour, size, rotation and position on a textured, noisy background; the pixel mask of every
object is known. Two-object images hold two shapes of different classes (the class-specificity test of
Chefer et al., CVPR 2021, Fig. 3).

Everything is a deterministic function of the seed.
"""
from __future__ import annotations

import json
import math
import os
import random
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------- text
TEXT_CLASSES = ["sports", "food", "weather", "finance"]

#: class-bearing keywords (every one a single word piece of the bert-base-uncased vocabulary)
KEYWORDS: Dict[str, List[str]] = {
    "sports": ["goal", "match", "team", "coach", "striker", "tournament", "referee", "stadium", "league",
               "player", "champion", "basketball", "tennis", "soccer", "football", "athlete"],
    "food": ["pizza", "soup", "recipe", "chef", "bread", "cheese", "pasta", "dessert", "salad", "kitchen",
             "restaurant", "sauce", "cake", "noodles", "breakfast", "dinner"],
    "weather": ["rain", "storm", "snow", "forecast", "thunder", "wind", "sunny", "cloudy", "temperature",
                "humid", "fog", "hurricane", "frost", "breeze", "weather", "rainfall"],
    "finance": ["stock", "market", "investor", "bank", "loan", "inflation", "shares", "profit", "bond",
                "currency", "earnings", "budget", "economy", "tax", "mortgage", "portfolio"],
}

#: clauses with one noun slot {x}; {a} is an optional adjective (a distractor or nothing)
CLAUSES = [
    "yesterday my friend talked about the {a}{x}",
    "everyone in town was thinking about the {a}{x}",
    "the {a}{x} was on my mind all morning",
    "we heard something about the {a}{x} again",
    "they said the {a}{x} seemed different",
    "after lunch our neighbors mentioned the {a}{x}",
    "nobody expected the {a}{x} to matter",
    "my sister wrote about the {a}{x}",
    "later that evening the {a}{x} came up again",
    "people kept asking about the {a}{x}",
    "the {a}{x} was all anyone could discuss",
    "i read a short piece about the {a}{x}",
    "my uncle kept talking about the {a}{x}",
    "at the office we joked about the {a}{x}",
]
CONNECTORS = [" and ", " but ", " so ", " , then ", " while ", " because ", " . "]
#: neutral nouns for slots without a keyword
NEUTRAL = ["thing", "plan", "idea", "trip", "picture", "letter", "meeting", "problem", "question", "visit",
           "photo", "schedule", "garden", "project", "car", "book", "door", "party", "journey", "situation"]
#: distractors: topic-sounding words equally frequent in every class (adjectives, and nouns in neutral slots)
DISTRACTOR_ADJ = ["big", "local", "important", "huge", "surprising", "weekend", "latest", "famous"]
DISTRACTOR_NOUN = ["news", "report", "story", "event", "announcement"]


def text_sample(rng: random.Random, mixed: bool) -> Dict:
    """One sentence: {"text", "label", "rationale" (character spans of the label's keywords),
    "minority", "minority_rationale", "mixed", "counts"}."""
    c = TEXT_CLASSES
    label = rng.randrange(len(c))
    if mixed:
        other = rng.choice([k for k in range(len(c)) if k != label])
        n_major, n_minor = 2, 1
    else:
        other, n_major, n_minor = None, rng.choice([1, 1, 2, 2, 3]), 0
    n_kw = n_major + n_minor
    n_clauses = max(n_kw, rng.choice([2, 3]))
    slots = list(range(n_clauses))
    rng.shuffle(slots)
    owner = {}
    for s in slots[:n_major]:
        owner[s] = label
    for s in slots[n_major:n_kw]:
        owner[s] = other
    clauses = rng.sample(CLAUSES, n_clauses)
    text, spans = "", {label: [], other: []}
    for i, clause in enumerate(clauses):
        if i:
            text += rng.choice(CONNECTORS)
        adj = rng.choice(DISTRACTOR_ADJ) + " " if rng.random() < 0.3 else ""
        if i in owner:
            word = rng.choice(KEYWORDS[c[owner[i]]])
        else:
            word = rng.choice(DISTRACTOR_NOUN) if rng.random() < 0.25 else rng.choice(NEUTRAL)
        pre, post = clause.split("{a}{x}")
        text += pre + adj
        if i in owner:
            spans[owner[i]].append([len(text), len(text) + len(word)])
        text += word + post
    return {"text": text, "label": label, "rationale": spans[label], "mixed": mixed,
            "minority": other, "minority_rationale": spans[other] if other is not None else [],
            "counts": [n_major, n_minor]}


def text_dataset(n: int, seed: int, mixed_fraction: float = 0.4) -> List[Dict]:
    rng = random.Random(seed)
    return [text_sample(rng, rng.random() < mixed_fraction) for _ in range(n)]


def write_jsonl(records: Sequence[Dict], path: str, minority: bool = False) -> str:
    """The evaluation format of :class:`relprop.evaluation.RationaleJSONL` ({"text", "label",
    "rationale"} per line). ``minority=True`` writes the mixed sentences with their minority class as the
    label and the minority keywords as the rationale (the class-specificity test)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            if minority:
                if not r["mixed"]:
                    continue
                rec = {"text": r["text"], "label": r["minority"], "rationale": r["minority_rationale"]}
            else:
                rec = {"text": r["text"], "label": r["label"], "rationale": r["rationale"], "mixed": r["mixed"]}
            f.write(json.dumps(rec) + "\n")
    return path


# --------------------------------------------------------------------------------------------- vision
SHAPES = ["circle", "square", "triangle", "cross"]
IMAGE_SIZE = 64
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
#: background variation (0: flat grey + pixel noise, 1: full colour field and grating)
TEXTURE = 1.0
#: half-size ranges (pixels) of the shapes in one- and two-object images
SIZE_1 = (8.0, 14.0)
SIZE_2 = (7.0, 11.0)
#: largest rotation of a shape, degrees (uniform in [-ROTATION, ROTATION])
ROTATION = 20.0


def _shape_masks(kind: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, size: torch.Tensor, angle: torch.Tensor,
                 n: int) -> torch.Tensor:
    """[B, n, n] bool masks of one shape per image (kind index, centre, half-size, rotation)."""
    ys, xs = torch.meshgrid(torch.arange(n, dtype=torch.float32) + 0.5, torch.arange(n, dtype=torch.float32) + 0.5,
                            indexing="ij")
    dx, dy = xs[None] - cx[:, None, None], ys[None] - cy[:, None, None]
    ca, sa = torch.cos(angle)[:, None, None], torch.sin(angle)[:, None, None]
    u, v = (ca * dx + sa * dy) / size[:, None, None], (-sa * dx + ca * dy) / size[:, None, None]
    circle = u * u + v * v <= 1.0
    square = (u.abs() <= 0.82) & (v.abs() <= 0.82)
    # equilateral triangle inscribed in a circle of radius 1.15: three half-planes at distance r/2 from the
    # centre, their normals at 30, 150 and 270 degrees
    r = 1.15
    tri = torch.ones_like(circle)
    for a in (30.0, 150.0, 270.0):
        tri = tri & (u * math.cos(math.radians(a)) + v * math.sin(math.radians(a)) <= r / 2)
    cross = ((u.abs() <= 1.0) & (v.abs() <= 0.34)) | ((v.abs() <= 1.0) & (u.abs() <= 0.34))
    out = torch.stack([circle, square, tri, cross], 1)  # [B, 4, n, n]
    return out.gather(1, kind.view(-1, 1, 1, 1).expand(-1, 1, n, n))[:, 0]


def _background(g: torch.Generator, b: int, n: int, texture: float = 1.0) -> torch.Tensor:
    low = 0.25 + (torch.rand(b, 3, 4, 4, generator=g) - 0.5) * 0.3 * texture
    bg = F.interpolate(low, size=(n, n), mode="bicubic", align_corners=False)
    # a sinusoidal grating of random orientation and frequency (texture), then pixel noise
    theta = torch.rand(b, generator=g) * math.pi
    freq = torch.rand(b, generator=g) * 0.5 + 0.25
    ys, xs = torch.meshgrid(torch.arange(n, dtype=torch.float32), torch.arange(n, dtype=torch.float32), indexing="ij")
    phase = torch.rand(b, generator=g) * 2 * math.pi
    grating = torch.sin(freq[:, None, None] * (xs[None] * torch.cos(theta)[:, None, None] +
                                               ys[None] * torch.sin(theta)[:, None, None]) + phase[:, None, None])
    amp = torch.rand(b, 1, 1, 1, generator=g) * 0.12 * texture
    bg = bg + amp * grating[:, None]
    bg = bg + torch.randn(b, 3, n, n, generator=g) * 0.06
    return bg


def _colour_against(g: torch.Generator, bg_colour: torch.Tensor) -> torch.Tensor:
    """A random light colour (every channel in [0.55, 1]): the background is darker (about 0.1-0.4)."""
    return torch.rand(bg_colour.shape, generator=g) * 0.45 + 0.55


def image_batch(g: torch.Generator, b: int, objects: int = 1, n: int = IMAGE_SIZE, texture: float = TEXTURE,
                sizes: Tuple[float, float] = None, rotation: float = ROTATION) -> Dict[str, torch.Tensor]:
    """``b`` images with ``objects`` (1 or 2) shapes of different classes.

    Returns images [b, 3, n, n] in [0, 1] (quantized to 8 bits, as the PNG files), classes [b, objects],
    masks [b, objects, n, n] bool (each object's visible pixels).
    """
    img = _background(g, b, n, texture)
    kinds = torch.stack([torch.randperm(len(SHAPES), generator=g)[:objects] for _ in range(b)])  # different classes
    masks = torch.zeros(b, objects, n, n, dtype=torch.bool)
    lo, hi = sizes or ((SIZE_1 if objects == 1 else SIZE_2))
    size = torch.rand(b, objects, generator=g) * (hi - lo) + lo
    # positions: sampled jointly for all objects until they fit without overlap (a gap of 3+ pixels)
    cx = torch.zeros(b, objects)
    cy = torch.zeros(b, objects)
    done = torch.zeros(b, dtype=torch.bool)
    margin = size + 1.0
    for _ in range(200):
        x = margin + torch.rand(b, objects, generator=g) * (n - 2 * margin)
        y = margin + torch.rand(b, objects, generator=g) * (n - 2 * margin)
        ok = ~done
        for o in range(objects):
            for p in range(o):
                d = ((x[:, o] - x[:, p]) ** 2 + (y[:, o] - y[:, p]) ** 2).sqrt()
                ok &= d > (size[:, o] + size[:, p]) * 1.2 + 3.0
        cx[ok], cy[ok] = x[ok], y[ok]
        done |= ok
        if bool(done.all()):
            break
    if not bool(done.all()):
        raise RuntimeError("could not place the objects")
    for o in range(objects):
        angle = (torch.rand(b, generator=g) * 2 - 1) * math.radians(rotation)
        m = _shape_masks(kinds[:, o], cx[:, o], cy[:, o], size[:, o], angle, n)
        local = (img * m[:, None]).sum((2, 3)) / m[:, None].sum((2, 3)).clamp_min(1)  # background under the object
        col = _colour_against(g, local)
        tex = col[:, :, None, None] + torch.randn(b, 3, n, n, generator=g) * 0.04
        img = torch.where(m[:, None], tex, img)
        masks[:, o] = m
    img = (img.clamp(0, 1) * 255).round() / 255
    return {"images": img, "classes": kinds, "masks": masks}


def normalize(img: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(MEAN, device=img.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=img.device).view(1, 3, 1, 1)
    return (img - mean) / std


def write_image_folder(batch: Dict[str, torch.Tensor], root: str, prefix: str = "img") -> str:
    """The layout of :class:`relprop.evaluation.ImageMaskFolder`: images/*.png, masks/*.png (the
    union of the objects), labels.csv (the class of the first object)."""
    from PIL import Image
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    os.makedirs(os.path.join(root, "masks"), exist_ok=True)
    rows = ["name,label"]
    for i in range(batch["images"].shape[0]):
        name = f"{prefix}{i:05d}.png"
        arr = (batch["images"][i].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        Image.fromarray(arr).save(os.path.join(root, "images", name))
        m = (batch["masks"][i].any(0).numpy() * 255).astype(np.uint8)
        Image.fromarray(m).save(os.path.join(root, "masks", name))
        rows.append(f"{name},{int(batch['classes'][i, 0])}")
    with open(os.path.join(root, "labels.csv"), "w") as f:
        f.write("\n".join(rows) + "\n")
    return root
