"""Models dispatched by accelerate (``device_map``, CPU and disk offload): explained without moving
them, with the numbers of the same model loaded plainly, never holding all its weights at once."""
import weakref

import pytest
import torch
import transformers

import relprop
from relprop.graph import disk_cache
from relprop.graph.dispatch import OffloadedWeights, offloaded_weights
from tests import models

accelerate = pytest.importorskip("accelerate")

#: the tests that load and explain models take seconds each: slow suite (CI runs it); the refusals
#: stop before any explanation and stay in the fast suite
slow = pytest.mark.slow


def _mixtral():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=models.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2, pad_token_id=0)
    return transformers.MixtralForCausalLM(cfg).eval()


def _qwen2():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=models.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


#: family -> (plain model, options): Mixtral's router (topk) has no rule yet, so its MoE layers are
#: explained with the generic z-rule, the same way in the plain and the dispatched model
FAMILIES = {
    "llama": (models.hf_llama, {}),
    "qwen2": (_qwen2, {}),
    "gpt2": (models.hf_gpt2_lm, {}),
    "mixtral": (_mixtral, {"unsupported": "z_rule"}),
}


def _device_map(model):
    """Blocks alternately in CPU memory and on disk (the first in memory), and the other modules
    alternately too, as ``device_map="auto"`` with a small ``max_memory`` would place a large model."""
    places = {}

    def visit(prefix, module):
        for name, child in module.named_children():
            if isinstance(child, torch.nn.ModuleList):
                places.update({f"{prefix}{name}.{i}": ("cpu", "disk")[i % 2] for i in range(len(child))})
            elif any(isinstance(c, torch.nn.ModuleList) for c in child.modules()):
                visit(f"{prefix}{name}.", child)
            else:
                places[f"{prefix}{name}"] = ("cpu", "disk")[len(places) % 2]
    visit("", model)
    return places


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """family -> (plain model, the same checkpoint loaded with a device_map that puts about half of
    its weights in CPU memory and offloads the rest to disk)."""
    out = {}
    for name, (build, _) in FAMILIES.items():
        plain = build()
        ckpt = tmp_path_factory.mktemp(f"{name}_ckpt")
        plain.save_pretrained(ckpt)
        dispatched = type(plain).from_pretrained(ckpt, device_map=_device_map(plain),
                                                 offload_folder=str(tmp_path_factory.mktemp(f"{name}_offload")),
                                                 attn_implementation=plain.config._attn_implementation).eval()
        out[name] = (plain, dispatched)
    return out


def _ids():
    return models.decoder_batch(lengths=(7, 5))


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@slow
def test_the_fixture_offloads_to_cpu_and_disk(loaded):
    for name, (_, dm) in loaded.items():
        places = set(dm.hf_device_map.values())
        assert "disk" in places and "cpu" in places, (name, dm.hf_device_map)
        assert any(p.device.type == "meta" for p in dm.parameters())


@slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("method,memory", [("transformer_attribution", "default"), ("transformer_attribution", "low"),
                                           ("lrp", "default"), ("gradient_rollout", "default")])
def test_offloaded_model_gives_the_plain_models_numbers(loaded, family, method, memory):
    plain, dm = loaded[family]
    opts = dict(FAMILIES[family][1], method=method, memory=memory)
    want = relprop.explain(plain, _ids(), **opts)
    got = relprop.explain(dm, _ids(), **opts)
    assert _rel(got.target_scores, want.target_scores) <= 1e-5
    assert _rel(got.scores, want.scores) <= 1e-5, (family, method, memory)


@slow
def test_lrp_presets_and_input_gradient_agree(loaded):
    plain, dm = loaded["llama"]
    for opts in ({"method": "lrp", "preset": "attnlrp", "fast_path": False}, {"method": "lrp", "preset": "cp_lrp"},
                 {"method": "input_x_gradient"}):
        want = relprop.explain(plain, _ids(), **opts)
        got = relprop.explain(dm, _ids(), **opts)
        assert _rel(got.scores, want.scores) <= 1e-5, opts


def _snapshot(model):
    return {
        "params": [(n, id(p), p.device, p.dtype, p.requires_grad) for n, p in model.named_parameters()],
        "buffers": [(n, id(b), b.device) for n, b in model.named_buffers()],
        "hooks": [(n, id(m.__dict__.get("_hf_hook")), id(m.__dict__.get("forward"))) for n, m in model.named_modules()],
        "training": [m.training for m in model.modules()],
        "offloaded": {k: (id(wm), key) for k, (wm, key, _) in offloaded_weights(model).sources.items()},
    }


@slow
def test_model_untouched(loaded):
    plain, dm = loaded["llama"]
    with torch.no_grad():  # (accelerate's hooks put new Parameter objects in the modules at each call)
        logits = dm(**_ids()).logits
    before = _snapshot(dm)
    for memory in ("default", "low"):
        relprop.explain(dm, _ids(), method=["transformer_attribution", "lrp"], memory=memory)
    assert _snapshot(dm) == before
    with torch.no_grad():
        assert torch.equal(dm(**_ids()).logits, logits)  # the hooks still load the same weights


@slow
def test_weights_are_never_all_loaded_at_once(tmp_path, monkeypatch):
    """Each offloaded weight is read when a node needs it and dropped after; autograd keeps the ones
    it saves as names. Count the fetched weights alive at once through a whole explanation of a
    model whose weights are all on disk."""
    dm = accelerate.disk_offload(models.hf_llama(), str(tmp_path), execution_device="cpu")
    fetch = OffloadedWeights.fetch
    alive, peak, fetches = set(), [0], [0]

    def counting(self, name):
        v = fetch(self, name)
        key = object()
        alive.add(key)
        weakref.finalize(v, alive.discard, key)
        fetches[0] += 1
        peak[0] = max(peak[0], len(alive))
        return v

    monkeypatch.setattr(OffloadedWeights, "fetch", counting)
    total = len(offloaded_weights(dm).sources)
    assert total == len(list(dm.parameters()))
    for method, memory in (("transformer_attribution", "default"), ("transformer_attribution", "low"),
                           ("lrp", "default"), ("lrp", "low")):
        peak[0] = fetches[0] = 0
        relprop.explain(dm, _ids(), method=method, memory=memory)
        assert fetches[0] >= total  # every weight was used...
        assert peak[0] <= 3, (method, memory, peak[0], total)  # ...a few at a time


def test_several_devices_refused():
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    model = models.hf_llama()
    add_hook_to_module(model.model.layers[1], AlignDevicesHook(execution_device=torch.device("cuda", 1)))
    with pytest.raises(relprop.DispatchError, match="several devices") as e:
        relprop.explain(model, _ids())
    assert isinstance(e.value, relprop.RelpropError) and "one GPU" in str(e.value)


def test_meta_weights_without_a_holder_refused():
    from accelerate import init_empty_weights
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    with init_empty_weights():
        model = models.hf_llama()
    add_hook_to_module(model, AlignDevicesHook(execution_device=torch.device("cpu"), io_same_device=True))
    with pytest.raises(relprop.DispatchError, match="no accelerate hook holds its value"):
        relprop.explain(model, _ids())


@slow
def test_cpu_offload_and_disk_offload(tmp_path):
    """accelerate's own helpers: every weight in a CPU state dict, or every weight on disk."""
    plain = models.hf_llama()
    want = relprop.explain(plain, _ids())
    for offload in (lambda m: accelerate.cpu_offload(m, execution_device="cpu"),
                    lambda m: accelerate.disk_offload(m, str(tmp_path), execution_device="cpu")):
        model = models.hf_llama()
        offload(model)
        assert offloaded_weights(model) is not None
        got = relprop.explain(model, _ids())
        assert _rel(got.scores, want.scores) <= 1e-5


@slow
def test_dispatched_models_stay_off_the_disk_cache(loaded):
    _, dm = loaded["llama"]
    assert disk_cache.key_of(dm, _ids(), "input_ids", ()) is None
    model = models.hf_llama()  # hooks that only move the inputs: all weights on the one device
    accelerate.hooks.add_hook_to_module(model, accelerate.hooks.AlignDevicesHook(execution_device="cpu",
                                                                                 io_same_device=True))
    assert offloaded_weights(model) is None  # the usual path
    assert disk_cache.key_of(model, _ids(), "input_ids", ()) is None
    assert _rel(relprop.explain(model, _ids()).scores, relprop.explain(models.hf_llama(), _ids()).scores) <= 1e-5
