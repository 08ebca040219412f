"""Loading the model a command explains, offline: a local folder, a timm name, a HuggingFace hub id in
the local cache, or the bundled demo; and running it on the inputs."""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..tools import demo
from ..api import DEFAULT_PRESET, explain
from ..errors import MethodError
from ..methods import get_method
from ..rules import presets
from ..targets import logits_of
from .common import EXIT_MODEL, CliError, DEMO_NAME, one_line, parse_options, resolve_class
from .early_checks import check_option_keys
from .known_names import EXPLAIN_SETTINGS


def parse_methods(values: Sequence[str], default: str) -> List[str]:
    """Method names from repeated/comma-separated --method values, checked against the registry."""
    names = [n.strip() for v in values for n in v.split(",") if n.strip()] or [default]
    names = list(dict.fromkeys(names))
    for n in names:
        try:
            get_method(n)
        except MethodError as err:
            raise CliError(f"unknown method: {err} Run 'relprop methods' for the table.") from None
    return names


@dataclasses.dataclass
class Loaded:
    """A loaded model with what the command line needs around it."""

    model: Any
    kind: str  # "image" or "text"
    name: str
    labels: Optional[Dict[int, str]] = None
    tokenizer: Any = None
    preprocess: Optional[Callable] = None  # image -> [C, H, W] tensor
    mean: Any = None
    std: Any = None
    options: dict = dataclasses.field(default_factory=dict)  # method options, passed to the methods taking them
    default_options: dict = dataclasses.field(default_factory=dict)  # explain() options of the default method
    default_method: str = "transformer_attribution"
    note: str = ""
    cosine_scale: Optional[float] = None  # the demo: score = scale × cosine
    why: str = ""  # why the default method explains this model (the demo says it on its page)
    preset: Optional[str] = None  # --preset: the rules of every method (over default_options' preset)
    settings: dict = dataclasses.field(default_factory=dict)  # explain() settings from --option (keep_blocks=...)


def load_model(spec: str) -> Loaded:
    """Load ``spec`` offline: a local folder (HuggingFace save_pretrained or timm save_for_hf), a timm
    model name, or a HuggingFace hub id present in the local cache."""
    spec = spec.strip()
    if not spec:
        raise CliError("--model is empty", EXIT_MODEL)
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return _load_folder(path, spec)
    if os.path.exists(path):
        raise CliError(f"--model {spec} is a file; give a folder saved with save_pretrained, a timm model name "
                       "or a HuggingFace hub id", EXIT_MODEL)
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec:
        raise CliError(f"model folder not found: {spec}", EXIT_MODEL)
    import timm
    if "/" not in spec and timm.is_model(spec):
        return _load_timm(spec)
    folder = _hub_cache_folder(spec)
    if folder is not None:
        return _load_folder(folder, spec, hub_id=spec)
    if "/" in spec:
        raise CliError(f"cannot load '{spec}' offline: it is not a local folder, and no copy of it is in the "
                       "local HuggingFace cache (relprop never downloads; fetch it once with internet access, "
                       "e.g. `hf download " + spec + "`, or pass a folder saved with save_pretrained)", EXIT_MODEL)
    close = difflib.get_close_matches(spec, timm.list_models(), n=3, cutoff=0.75)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise CliError(f"unknown model '{spec}': not a local folder, not a timm model name, and not a HuggingFace "
                   f"hub id in the local cache.{hint}", EXIT_MODEL)


def _hub_cache_folder(repo_id: str) -> Optional[str]:
    """The snapshot folder of ``repo_id`` in the local HuggingFace cache, if its config is there."""
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id
        return None
    return os.path.dirname(found) if isinstance(found, str) and os.path.isfile(found) else None


def _load_timm(name: str, source: Optional[str] = None) -> Loaded:
    import timm
    offline = (f"cannot load timm model '{name}' offline: its pretrained weights are not in the local cache "
               "(relprop never downloads; run timm.create_model(name, pretrained=True) once with internet access)")
    if source is None:
        _timm_weights_cached_or_fail(name, offline)
    try:
        model = timm.create_model(source or name, pretrained=True)
    except (OSError, ValueError) as err:  # LocalEntryNotFoundError is an OSError
        if source is None or not source.startswith("local-dir:"):
            raise CliError(offline, EXIT_MODEL) from None
        raise CliError(f"cannot load timm model folder {name}: {one_line(err)}", EXIT_MODEL) from None
    except Exception as err:  # noqa: BLE001
        raise CliError(f"cannot load timm model '{name}': {type(err).__name__}: {one_line(err)}",
                       EXIT_MODEL) from None
    model.eval()
    cfg = timm.data.resolve_data_config({}, model=model)
    transform = timm.data.create_transform(**cfg)
    labels = _timm_labels(model)
    return Loaded(model, "image", name, labels=labels, preprocess=lambda img: transform(img), mean=cfg["mean"],
                  std=cfg["std"])


def _timm_weights_cached_or_fail(name: str, message: str) -> None:
    """timm downloads weights from the HuggingFace hub (made offline above) or, for a few old models, from
    a URL: refuse before timm tries a URL whose file is not in torch's cache."""
    from timm.models import get_pretrained_cfg
    cfg = get_pretrained_cfg(name)
    if cfg is None:
        raise CliError(f"timm model '{name}' has no pretrained weights", EXIT_MODEL)
    if cfg.hf_hub_id:
        return
    url = cfg.url or ""
    if url:
        import torch.hub
        cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url.split("?")[0]))
        if os.path.isfile(cached):
            return
    raise CliError(message, EXIT_MODEL)


def _timm_labels(model) -> Optional[Dict[int, str]]:
    try:
        import timm.data
        names = (getattr(model, "pretrained_cfg", {}) or {}).get("label_names")
        n = model.num_classes
        if names and len(names) == n:
            return {i: str(x) for i, x in enumerate(names)}
        subset = timm.data.infer_imagenet_subset(model)
        if subset:
            info = timm.data.ImageNetInfo(subset)
            return {i: info.index_to_description(i) for i in range(n)}
    except Exception:  # noqa: BLE001 - no names: indices only
        pass
    return None


def _load_folder(folder: str, spec: str, hub_id: Optional[str] = None) -> Loaded:
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise CliError(f"model folder {spec} has no config.json: save the model with save_pretrained "
                       "(HuggingFace) or timm.models.save_for_hf (timm)", EXIT_MODEL)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as err:
        raise CliError(f"cannot read {cfg_path}: {err}", EXIT_MODEL) from None
    if "architecture" in raw and "model_type" not in raw:  # a timm checkpoint
        return _load_timm(spec, ("hf-hub:" + hub_id) if hub_id else ("local-dir:" + folder))
    return _load_hf(folder, spec, raw)


IMAGE_HEADS = ("ForImageClassification", "ForImageClassificationWithTeacher")


def _load_hf(folder: str, spec: str, raw: dict) -> Loaded:
    import transformers
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # noqa: BLE001
        raise CliError(f"cannot read the config of {spec}: {one_line(err)}", EXIT_MODEL) from None
    arch = (getattr(config, "architectures", None) or [""])[0] or ""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES as IMG,
                                                        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as SEQ)
    mt = getattr(config, "model_type", "")
    if arch.endswith(IMAGE_HEADS):
        kind = "image"
    elif arch.endswith("ForSequenceClassification"):
        kind = "text"
    elif not arch and mt in IMG and mt not in SEQ:
        kind = "image"
    elif not arch and mt in SEQ and mt not in IMG:
        kind = "text"
    else:
        what = f"a {arch}" if arch else f"a '{mt}' model"
        raise CliError(f"{spec} is {what} without a classification head: relprop explain needs an image or "
                       "sequence classifier (…ForImageClassification / …ForSequenceClassification)"
                       + ("; for the bundled sentence encoder run 'relprop demo'" if kind_hint(mt) else ""),
                       EXIT_MODEL)
    if kind == "image":
        cls = getattr(transformers, arch, None) if arch.endswith("WithTeacher") else None
        cls = cls or transformers.AutoModelForImageClassification
    else:
        cls = transformers.AutoModelForSequenceClassification
    try:
        model = cls.from_pretrained(folder, local_files_only=True).eval()
    except Exception as err:  # noqa: BLE001
        raise CliError(f"cannot load {spec} offline: {one_line(err)}", EXIT_MODEL) from None
    labels = {int(k): str(v) for k, v in (getattr(model.config, "id2label", None) or {}).items()} or None
    if kind == "text":
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as err:  # noqa: BLE001
            raise CliError(f"no tokenizer saved with {spec} ({one_line(err)}): save one next to the model with "
                           "tokenizer.save_pretrained(folder)", EXIT_MODEL) from None
        return Loaded(model, "text", spec, labels=labels, tokenizer=tok)
    preprocess, mean, std, note = _hf_image_preprocess(folder, model.config)
    return Loaded(model, "image", spec, labels=labels, preprocess=preprocess, mean=mean, std=std, note=note)


def kind_hint(model_type: str) -> bool:
    return model_type in ("bert", "roberta", "mpnet", "distilbert")


def _hf_image_preprocess(folder: str, config):
    from transformers import AutoImageProcessor
    try:
        proc = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    except Exception:  # noqa: BLE001 - none saved: resize + normalise from the config
        proc = None
    if proc is not None:
        mean = getattr(proc, "image_mean", None) if getattr(proc, "do_normalize", True) else None
        std = getattr(proc, "image_std", None) if getattr(proc, "do_normalize", True) else None

        def run(img):
            return proc(images=img, return_tensors="pt")["pixel_values"][0]
        return run, mean, std, ""
    import numpy as np
    import torch
    size = getattr(config, "image_size", 224)
    size = (size, size) if isinstance(size, int) else tuple(size)
    mean = std = (0.5, 0.5, 0.5)

    def run(img):
        a = np.asarray(img.convert("RGB").resize((size[1], size[0])), dtype=np.float32) / 255.0
        t = torch.from_numpy(a).permute(2, 0, 1)
        return (t - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    return run, mean, std, (f"no image processor saved with the model: resizing to {size[0]}x{size[1]} and "
                            "normalising with mean = std = 0.5")


def load_demo(label_names: Optional[str] = None) -> Loaded:
    try:
        labels = demo.labels_from_names(label_names.split(",")) if label_names else None
        if label_names and not labels:
            raise CliError("--labels names no label")
        model, tok = demo.load(labels)
    except demo.DemoUnavailable as err:
        raise CliError(str(err), EXIT_MODEL) from None
    return Loaded(model, "text", DEMO_NAME, labels=dict(model.config.id2label), tokenizer=tok,
                  options=dict(demo.METHOD_OPTIONS), default_options=dict(demo.OPTIONS),
                  default_method=demo.DEFAULT_METHOD, cosine_scale=model.scale,
                  why=f"{demo.DEFAULT_METHOD} under preset '{demo.OPTIONS['preset']}': {demo.WHY}")


def num_classes(loaded: Loaded) -> Optional[int]:
    """The number of classes, when the model says it without a forward pass."""
    cfg = getattr(loaded.model, "config", None)
    n = getattr(loaded.model, "num_classes", None) or getattr(cfg, "num_labels", None)
    if loaded.labels:
        n = n or len(loaded.labels)
    return int(n) if n else None


def early_target(loaded: Loaded, spec) -> Optional[int]:
    """``--target`` checked before any work (when the model's class count is known)."""
    if spec is None:
        return None
    n = num_classes(loaded)
    return resolve_class(spec, loaded.labels, n) if n else None


def check_preset(name: Optional[str]) -> None:
    """``--preset``: a registered preset (checked before the model is loaded)."""
    if name is not None and name not in presets():
        close = difflib.get_close_matches(name, list(presets()), n=1)
        raise CliError(f"unknown --preset {name!r}: one of {', '.join(presets())}"
                       + (f" (did you mean {close[0]!r}?)" if close else ""))


def apply_settings(loaded: Loaded, names: List[str], args) -> None:
    """``--preset`` and ``--option`` onto the explain settings of ``loaded``; an option that none of the
    asked methods takes is an error that lists the options they take."""
    options = parse_options(args.option)
    check_option_keys(list(options), names)
    loaded.settings.update({k: v for k, v in options.items() if k in EXPLAIN_SETTINGS})
    loaded.options.update({k: v for k, v in options.items() if k not in EXPLAIN_SETTINGS})
    if args.preset:
        loaded.preset = args.preset


def method_options(name: str, options: dict) -> dict:
    takes = get_method(name).options
    return {k: v for k, v in options.items() if k in takes}


def run_methods(loaded: Loaded, inputs, target, names: List[str]):
    """One explain() call for all methods (they share the forward pass); options only where they apply.
    The default method with its own explain() options (the demo's preset) is explained in a call of its own,
    unless ``--preset`` gives every method the same rules."""
    own = [n for n in names if n == loaded.default_method and loaded.default_options and loaded.preset is None]
    rest = [n for n in names if n not in own]
    out = {}
    if own:
        out[own[0]] = explain(loaded.model, inputs, target=target, method=own[0],
                              **{**loaded.default_options, **loaded.settings, **method_options(own[0], loaded.options)})
    if rest:
        opts = dict(loaded.settings) if loaded.preset is None else {**loaded.settings, "preset": loaded.preset}
        for n in rest:
            opts.update(method_options(n, loaded.options))
        out.update(zip(rest, explain(loaded.model, inputs, target=target, method=list(rest), **opts)))
    return [out[n] for n in names]


def class_scores(model, inputs):
    import torch
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return logits_of(out).float()


def method_label(name: str, loaded: Loaded) -> str:
    """``name``, with the preset whose rules it walks when it reads relevance ("lrp under preset 'attnlrp'"):
    ``--preset``, else the model's default method's preset, else the method's own, else relprop's default."""
    info = get_method(name)
    if not info.needs_relevance:
        return name
    preset = loaded.preset or (loaded.default_options.get("preset") if name == loaded.default_method else None)
    return f"{name} under preset '{preset or info.preset or DEFAULT_PRESET}'"
