"""``relprop explain --image``: explain a classifier's predictions on image files."""
from __future__ import annotations

import os
import sys
from typing import List, Sequence

from ..viz import image as vimg
from .common import EXIT_OK, CliError, chunks, one_line, prepare_out, resolve_class
from .loading import Loaded, class_scores, early_target, run_methods


def class_label(labels, t: int) -> str:
    return vimg.label_name(labels, t)


def explain_images(loaded: Loaded, paths: List[str], names: List[str], args) -> int:
    import torch
    from PIL import Image, UnidentifiedImageError
    from rich.console import Console
    console = Console(highlight=False, soft_wrap=True)
    early_target(loaded, args.target)
    out = prepare_out(args.out)
    pixels = []
    for p in paths:
        try:
            with Image.open(p) as im:
                pixels.append(loaded.preprocess(im.convert("RGB")))
        except (UnidentifiedImageError, OSError) as err:
            raise CliError(f"cannot read image {p}: {getattr(err, 'strerror', None) or one_line(err)}") from None
    if len({tuple(x.shape) for x in pixels}) != 1:
        raise CliError("the preprocessed images differ in size; explain them one at a time")
    if loaded.note:
        print(f"note: {loaded.note}", file=sys.stderr)
    console.print(f"model: {loaded.name}   method{'s' if len(names) > 1 else ''}: {', '.join(names)}")
    written = []
    stems = _unique_stems(paths)
    for s, e in chunks(len(paths), args.batch_size):
        x = torch.stack(pixels[s:e])
        logits = class_scores(loaded.model, x)
        n = logits.shape[1]
        target = resolve_class(args.target, loaded.labels, n) if args.target is not None else None
        exps = run_methods(loaded, x, target, names)
        probs = logits.softmax(-1)
        for j in range(e - s):
            i = s + j
            pred = int(logits[j].argmax())
            t = int(exps[0].target[j])

            def cls(k):
                named = loaded.labels is not None and k in loaded.labels
                return (f"{class_label(loaded.labels, k)} (class {k}, " if named else f"class {k} (") + \
                    f"score {float(logits[j, k]):.4g}, p={float(probs[j, k]):.3f})"
            line = f"{paths[i]}: predicted {cls(pred)}" + ("" if t == pred else f"; explained {cls(t)}")
            console.print(line)
            if out is None:
                continue
            for exp in exps:
                fig = vimg.overlay_figure(exp, j, x[j], labels=loaded.labels, mean=loaded.mean, std=loaded.std,
                                          percentile=args.percentile)
                written.append(vimg.save_figure(fig, os.path.join(out, f"{stems[i]}_{exp.method}.png")))
            if len(exps) > 1:
                fig = vimg.grid_figure(exps, x, indices=[j], labels=loaded.labels, mean=loaded.mean,
                                       std=loaded.std, percentile=args.percentile,
                                       row_titles=[f"{class_label(loaded.labels, t)} "
                                                   f"(score {float(logits[j, t]):.3g})"])
                written.append(vimg.save_figure(fig, os.path.join(out, f"{stems[i]}_grid.png")))
    for w in written:
        console.print(f"wrote {w}")
    return EXIT_OK


def _unique_stems(paths: Sequence[str]) -> List[str]:
    stems, seen = [], {}
    for p in paths:
        stem = os.path.splitext(os.path.basename(p))[0] or "image"
        k = seen.get(stem, 0)
        seen[stem] = k + 1
        stems.append(stem if k == 0 else f"{stem}_{k + 1}")
    return stems
