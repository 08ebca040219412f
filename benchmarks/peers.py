"""relprop against its peers on the same model and input, in one process: a markdown table.

Rows, each timed interleaved with one forward+backward pass of the model (weight gradients, the
unit of every ratio), median of ``--repeats``: relprop's methods; the authors' Transformer
Attribution (``--authors`` a work tree of hila-chefer/Transformer-Explainability, weights copied
as in ``benchmarks/authors_reference.py``; ViT only here); LXT 2.1's AttnLRP (gradient × input,
input relevance only: the parameters do not require gradients); captum's IntegratedGradients with
``--ig-steps`` steps (and relprop's ``integrated_gradients`` with the same number).

LXT 2.1 does not import under transformers 5 (its bundled BERT/LLaMA copies import
``find_pruneable_heads_and_indices`` and ``modeling_attn_mask_utils``, since removed); this process
adds the first name and puts a stand-in for LXT's BERT module (not run here) before importing it.
It has no patch map for timm's ViT, so, as its README asks for unsupported models, one is given
here from LXT's own functions, the way LXT patches its supported models: LayerNorm →
``layer_norm_forward`` (identity rule through the variance), GELU → ``non_linear_forward``
(identity rule), and timm's ``Attention.forward`` → the same with LXT's ``divide_gradient`` on
q, k (÷4) and v (÷2) before the attention, as its ``wrap_attention_forward``. The patch is applied
to a copy of the model's classes only while LXT runs.

``--model llama``: a small LLaMA decoder with random weights (``LlamaForCausalLM`` from a
``LlamaConfig``: ``--layers`` layers of width 512, ``--tokens`` tokens), explained at the logit of
one token at the last position. LXT is applied as its README applies it to LLaMA:
``monkey_patch(modeling_llama)`` (its AttnLRP patch map: RMSNorm and gated-MLP forwards, the
attention functions wrapped with ``divide_gradient``), the parameters frozen, the word embeddings
fed as ``inputs_embeds`` with ``requires_grad``, ``use_cache=False``, one ``.backward()`` of the
target logit, relevance = (embeddings × gradient) summed over the hidden size. LXT 2.1 replaces
transformers' attention-function registry with a plain dict, which transformers 5 can no longer
look up (``get_interface``); this process wraps the patched dict back into the registry's class.
The patch is undone after each LXT run (relprop's capture and the fwd+bwd unit run unpatched).

    pip install -e ".[bench]"     # lxt, captum (and einops for the authors' code)
    python benchmarks/peers.py [--model vit|bert|llama] [--threads 1] [--repeats 3] [--authors /tmp/te]
                               [--device cpu|cuda] [--layers 4] [--tokens 128]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import timm
import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import relprop  # noqa: E402
import relprop.targets  # noqa: E402

METHODS = ("transformer_attribution", "lrp@attnlrp", "gradient_rollout", "rollout", "input_x_gradient")


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def score_of(logits, target):
    """The explained score: the target class, or for a decoder ([batch, tokens, vocab]) the target
    token's logit at the last position."""
    return logits[:, -1, target] if logits.dim() == 3 else logits[:, target]


def fwd_bwd(model, inputs, target):
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    score_of(logits_of(out), target).sum().backward()
    model.zero_grad(set_to_none=True)


@contextlib.contextmanager
def frozen(model):
    """Parameters without gradients (input relevance only), restored afterwards."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, f in flags:
            p.requires_grad_(f)


def lxt_functions():
    import types

    import transformers.models.bert.modeling_bert as modeling_bert
    import transformers.pytorch_utils as pu
    for name in ("find_pruneable_heads_and_indices", "prune_linear_layer", "apply_chunking_to_forward"):
        if not hasattr(pu, name):
            setattr(pu, name, None)
    # LXT's copy of BERT imports modules transformers 5.24 no longer has: a stand-in (BERT is not run)
    stand_in = types.ModuleType("lxt.efficient.models.bert")
    stand_in.modeling_bert, stand_in.attnLRP, stand_in.cp_LRP = modeling_bert, {}, {}
    sys.modules.setdefault("lxt.efficient.models.bert", stand_in)
    from lxt.efficient.patches import layer_norm_forward
    from lxt.efficient.rules import divide_gradient, identity_rule_implicit
    return layer_norm_forward, divide_gradient, identity_rule_implicit


@contextlib.contextmanager
def lxt_on_timm(model):
    """LXT 2.1's AttnLRP patches on a timm ViT's modules (instance-level, undone afterwards)."""
    layer_norm_forward, divide_gradient, identity = lxt_functions()
    from timm.models.vision_transformer import Attention

    def attention_forward(self, x, attn_mask=None, is_causal=False):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = divide_gradient(q, 4), divide_gradient(k, 4), divide_gradient(v, 2)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(self.norm(x.transpose(1, 2).reshape(B, N, self.attn_dim)))

    patched = []
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.forward = layer_norm_forward.__get__(m)
        elif isinstance(m, torch.nn.GELU):
            original = m.forward
            m.forward = (lambda orig: lambda x: identity(orig, x))(original)
        elif isinstance(m, Attention):
            m.forward = attention_forward.__get__(m)
        else:
            continue
        patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


def lxt_vit(model, x, target):
    with frozen(model), lxt_on_timm(model):
        xi = x.clone().requires_grad_(True)
        logits_of(model(xi))[:, target].sum().backward()
        return (xi * xi.grad).sum(1)


@contextlib.contextmanager
def lxt_on_llama():
    """LXT 2.1's ``monkey_patch(modeling_llama)`` (its default AttnLRP map), undone afterwards."""
    lxt_functions()
    from lxt.efficient import monkey_patch
    from transformers.models.llama import modeling_llama as ml
    from transformers.modeling_utils import AttentionInterface
    classes = [ml.LlamaMLP, ml.LlamaRMSNorm, torch.nn.Dropout]
    saved = [(c, c.__dict__.get("forward")) for c in classes]
    eager, registry = ml.eager_attention_forward, ml.ALL_ATTENTION_FUNCTIONS
    monkey_patch(ml, verbose=False)
    if not hasattr(ml.ALL_ATTENTION_FUNCTIONS, "get_interface"):  # LXT 2.1 leaves a plain dict
        wrapped = AttentionInterface()
        for k, v in ml.ALL_ATTENTION_FUNCTIONS.items():
            wrapped[k] = v
        ml.ALL_ATTENTION_FUNCTIONS = wrapped
    try:
        yield
    finally:
        for c, f in saved:
            if f is None:
                del c.forward
            else:
                c.forward = f
        ml.eager_attention_forward, ml.ALL_ATTENTION_FUNCTIONS = eager, registry


def lxt_llama(model, ids, target):
    """As LXT's README explains a LLaMA: embeddings × their gradient, summed over the hidden size."""
    with frozen(model), lxt_on_llama():
        emb = model.get_input_embeddings()(ids["input_ids"]).requires_grad_(True)
        logits = model(inputs_embeds=emb, attention_mask=ids["attention_mask"], use_cache=False).logits
        logits[:, -1, target].sum().backward()
        return (emb * emb.grad).float().sum(-1)


def captum_ig(model, x, target, steps):
    from captum.attr import IntegratedGradients
    with frozen(model):
        return IntegratedGradients(lambda t: logits_of(model(t))).attribute(
            x, target=target, n_steps=steps, method="riemann_middle", internal_batch_size=steps)


def authors_ta(device):
    """The authors' ViT Transformer Attribution on the same weights (their ViT_LRP + generator)."""
    import authors_reference as ar

    def build(model, checkout):
        A = ar.authors(checkout)
        kw = dict(img_size=224, patch_size=16, mlp_ratio=4, qkv_bias=True, embed_dim=768, depth=12, num_heads=12,
                  num_classes=1000)
        theirs = ar.load_same(A.vit_ours.VisionTransformer(**kw), model.state_dict(), torch.float32).to(device)
        theirs.norm.eps = model.norm.eps
        gen = A.vit_gen.LRP(theirs)

        def run(x, target):
            with ar.their_run(1e-9):
                return gen.generate_LRP(x, index=target, method="transformer_attribution", start_layer=0)
        return run
    return build


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("vit", "bert", "llama"), default="vit")
    p.add_argument("--layers", type=int, default=4, help="llama: decoder layers")
    p.add_argument("--tokens", type=int, default=128, help="llama: sequence length")
    p.add_argument("--methods", default=",".join(METHODS), help="relprop methods to time")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--authors", default=None, help="work tree of hila-chefer/Transformer-Explainability")
    p.add_argument("--ig-steps", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dev, target = args.device, 1
    torch.manual_seed(0)
    if args.model == "vit":
        model = timm.create_model("vit_base_patch16_224", pretrained=False).eval().to(dev)
        x = torch.randn(1, 3, 224, 224, device=dev)
        name = "timm vit_base_patch16_224, batch 1"
    else:
        model = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2)).eval().to(dev)
        x = {"input_ids": torch.randint(1000, 30000, (1, 128), device=dev),
             "attention_mask": torch.ones(1, 128, dtype=torch.long, device=dev)}
        name = "BERT-base, 128 tokens, batch 1"
    if args.model == "llama":
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=max(256, args.tokens))
        model = transformers.LlamaForCausalLM(cfg).eval().to(dev)
        x = {"input_ids": torch.randint(3, cfg.vocab_size, (1, args.tokens), device=dev),
             "attention_mask": torch.ones(1, args.tokens, dtype=torch.long, device=dev)}
        target = 7  # the logit of token 7 at the last position
        name = (f"LlamaForCausalLM, {args.layers} layers, hidden 512, {args.tokens} tokens, batch 1 "
                f"({sum(q.numel() for q in model.parameters()) / 1e6:.0f}M parameters)")
    explained = relprop.targets.next_token(x["attention_mask"], token=target) if args.model == "llama" else target
    runs = {}
    for m in args.methods.split(",") if args.methods else ():
        method, _, preset = m.partition("@")
        kw = {"preset": preset} if preset else {}
        runs[f"relprop {m}"] = (lambda method, kw: lambda: relprop.explain(model, x, target=explained, method=method,
                                                                           **kw))(method, kw)
    if args.ig_steps:
        runs[f"relprop integrated_gradients ({args.ig_steps} steps)"] = lambda: relprop.explain(
            model, x, target=explained, method="integrated_gradients", n_steps=args.ig_steps)
    if args.model == "llama":
        runs["LXT 2.1 AttnLRP, monkey_patch (input relevance only)"] = lambda: lxt_llama(model, x, target)
    if args.model == "vit":
        runs["LXT 2.1 AttnLRP (input relevance only)"] = lambda: lxt_vit(model, x, target)
        if args.ig_steps:
            runs[f"captum IntegratedGradients ({args.ig_steps} steps)"] = lambda: captum_ig(model, x, target,
                                                                                           args.ig_steps)
        if args.authors:
            their = authors_ta(dev)(model, args.authors)
            runs["authors' Transformer Attribution (HEAD)"] = lambda: their(x, target)
    load0 = os.getloadavg()[0]
    for k, fn in runs.items():  # capture, warm up
        t = time.perf_counter()
        fn()
        print(f"warm-up {k}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    agreement = ""
    if args.model == "llama":  # the same work: LXT's input relevance against relprop's
        e = relprop.explain(model, x, target=explained, method="lrp", preset="attnlrp")
        # both start from the target logit's value (relprop's "attnlrp" seed="score")
        ours = e.input_relevance[0].double()
        theirs = lxt_llama(model, x, target)[0].detach().double()
        agreement = (f"LXT vs relprop lrp@attnlrp input relevance: max |diff| / "
                     f"max |R| = {float((ours - theirs).abs().max() / theirs.abs().max()):.1e}, "
                     f"sums {float(ours.sum()):.4g} / {float(theirs.sum()):.4g}\n")
    fwd_bwd(model, x, target)
    times = {"fwd+bwd (weight gradients)": []}
    times.update({k: [] for k in runs})
    for _ in range(args.repeats):
        for k in times:
            fn = runs.get(k, lambda: fwd_bwd(model, x, target))
            sync(dev)
            t = time.perf_counter()
            fn()
            sync(dev)
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    fb = med["fwd+bwd (weight gradients)"]
    print(f"{name}; torch {torch.__version__}, device {dev}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}, load {load0:.2f} -> {os.getloadavg()[0]:.2f}\n")
    print(agreement + "| what | ms | ratio to fwd+bwd |\n|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v * 1e3:.0f} | {v / fb:.2f} |")


if __name__ == "__main__":
    main()
