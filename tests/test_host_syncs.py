"""At most one host read per ``explain()`` call on an accelerator (relprop.graph.host_reads,
``Tuning(host_reads="end")``, the default there), for every method, preset and memory mode: counted with
relprop.tools.launch_count on tiny models on the CPU (a host sync is an op whose result the host waits for:
``.item()``, ``bool(t)``, ``nonzero``, ``.tolist()``, ...). The call's checks and warnings are read together
at its end; what it computed under an assumption verified on the device equals what the call computes
reading values where they decide (``"as_needed"``, the CPU's default), and where an assumption fails the
call is computed again carefully, with a note."""
import functools

import pytest
import torch
import transformers

import models
import relprop
from chunking import rows
from relprop.tools.launch_count import count

END, AS_NEEDED = relprop.Tuning(host_reads="end"), relprop.Tuning(host_reads="as_needed")

#: every method with the options that make it run on a tiny model; lrp under each preset
CALLS = [(m, {}) for m in relprop.methods() if m not in ("lrp", "smoothgrad", "integrated_gradients", "vit_cx")]
CALLS += [("lrp", {"preset": p}) for p in ("lrp", "chefer2021", "attnlrp", "cp_lrp")]
CALLS += [("smoothgrad", {"n_samples": 3}), ("integrated_gradients", {"n_steps": 3})]


@functools.lru_cache(maxsize=None)
def _case(name):
    """(model, inputs, target): a tiny LLaMA with 2 × 40 positions (so that the layers next to the output
    compute on the rows the target reads), a padded BERT, a ViT."""
    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = transformers.LlamaForCausalLM(cfg).eval()
        return model, models.decoder_batch(lengths=(40, 33)), "next_token"
    if name == "bert":
        return models.hf_bert("eager"), models.text_batch(lengths=(9, 6)), 1
    model = models.timm_vit_tiny()
    return model, models.image_batch(model), 1


def _call(name, method, kw, tuning=END):
    model, x, target = _case(name)
    if "tuning" in kw:
        kw = {**kw, "tuning": relprop.Tuning(**{**kw["tuning"].__dict__, "host_reads": tuning.host_reads})}
    else:
        kw = {**kw, "tuning": tuning}
    return lambda: relprop.explain(model, x, target=target, method=method, **kw)


def _syncs(fn):
    fn()  # capture, warm-up
    c = count(fn, where=True, frames=3)
    return c.syncs, dict(c.sync_sites)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", ["llama", "bert", "vit"])
@pytest.mark.parametrize("method,kw", CALLS, ids=[f"{m}-{kw.get('preset', '')}" for m, kw in CALLS])
def test_one_host_read_per_call(name, method, kw):
    syncs, sites = _syncs(_call(name, method, kw))
    assert syncs <= 1, sites


MODES = [("memory low", {"memory": "low"}), ("memory high", {"memory": "high"}),
         ("folded, 3-row cores", {"keep_blocks": False, "tuning": rows(3)}),
         ("records dropped, 3-row cores", {"records_budget": 0, "tuning": rows(3)})]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", ["llama", "bert", "vit"])
@pytest.mark.parametrize("mode", [m for m, _ in MODES])
@pytest.mark.parametrize("method,kw", [("transformer_attribution", {}), ("gradient_rollout", {}), ("rollout", {}),
                                       ("lrp", {}), ("lrp", {"preset": "attnlrp"}), ("attcat", {})],
                         ids=["ta", "gr", "rollout", "lrp", "attnlrp", "attcat"])
def test_one_host_read_per_call_in_every_memory_mode(name, mode, method, kw):
    syncs, sites = _syncs(_call(name, method, {**kw, **dict(MODES)[mode]}))
    assert syncs <= 1, sites


def _same_numbers(name, method, kw):
    fn = _call(name, method, kw)
    fn()  # (the first call at a size reads what later ones assume, e.g. the causal chunks of the cores)
    fast = fn()
    slow = _call(name, method, kw, AS_NEEDED)()
    for field in ("scores", "input_relevance", "heads"):
        a, b = getattr(fast, field), getattr(slow, field)
        if b is None:
            assert a is None
            continue
        scale = b.abs().max().clamp_min(1e-30)
        assert float((a - b).abs().max() / scale) <= 1e-6, field
    assert not any("computed this call twice" in n for n in fast.notes)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", ["llama", "bert", "vit"])
@pytest.mark.parametrize("method,kw", [("transformer_attribution", {}), ("gradient_rollout", {}), ("lrp", {}),
                                       ("lrp", {"preset": "attnlrp"}), ("raw_attention", {})],
                         ids=["ta", "gr", "lrp", "attnlrp", "raw"])
def test_the_one_read_call_gives_the_careful_calls_numbers(name, method, kw):
    """The same scores, per-head rows and input relevance with nothing read until the end as with every
    value read where it decides (the rows next to the output found on the device, the query chosen there)."""
    _same_numbers(name, method, kw)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", ["llama", "bert", "vit"])
@pytest.mark.parametrize("mode", [m for m, _ in MODES])
@pytest.mark.parametrize("method,kw", [("transformer_attribution", {}), ("gradient_rollout", {}), ("lrp", {}),
                                       ("lrp", {"preset": "attnlrp"})], ids=["ta", "gr", "lrp", "attnlrp"])
def test_the_one_read_call_gives_the_careful_calls_numbers_in_every_memory_mode(name, mode, method, kw):
    """As above in the segmented and folded runs: cores in chunks of 3 rows on all their keys or on the keys
    a causal mask leaves them (assumed from the last call of the size, verified on the device), every chunk
    walked, the folded first block's per-head rows gathered on the device."""
    _same_numbers(name, method, {**kw, **dict(MODES)[mode]})


class _Cancels(torch.nn.Module):
    """Two linear layers; the second's Eq. 5 denominator x⁺W⁺ + x⁻W⁻ is 1e-5 of |x||W| on one output
    (a positive input against a weight that is almost all negative): float32 cancels there."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(2, 2)
        with torch.no_grad():
            self.a.weight.copy_(torch.tensor([[1.0, 0.5, 0.2], [0.3, 1.0, 0.4]]))
            self.a.bias.fill_(1.0)
            self.b.weight.copy_(torch.tensor([[1e-5, -1.0], [1.0, 1.0]]))
            self.b.bias.zero_()

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_failed_assumption_computes_the_call_again_with_a_note():
    """The one-read call assumes that no linear layer's Eq. 5 denominator cancels in float32 (it verifies it
    on the device). Where one does, the call is computed again carefully: the numbers of the careful scope
    (whose exact recomputation of the cancelling outputs keeps R ≥ 0) and a note that says why."""
    model = _Cancels().eval()
    x = torch.rand(2, 3) + 0.5
    exp = relprop.explain(model, x, target=0, method="lrp", preset="chefer2021", tuning=END)
    ref = relprop.explain(model, x, target=0, method="lrp", preset="chefer2021", tuning=AS_NEEDED)
    (note,) = [n for n in exp.notes if "computed this call twice" in n]
    assert "cancels in float32" in note
    assert torch.equal(exp.input_relevance, ref.input_relevance)


def test_a_target_that_reads_more_rows_than_it_says_is_computed_again():
    """A target's ``rows_read`` bounds the rows the layers next to the output compute on; a target that
    reads more than it says is caught on the device and the call computed again, every row read."""
    model, x, _ = _case("llama")

    class Liar:
        def rows_read(self, batch):
            return 1  # reads 2 rows per sample below

        def __call__(self, outputs):
            logits = outputs.logits
            return logits[:, 10, 5] + logits[:, 20, 6]
    exp = relprop.explain(model, x, target=Liar(), method="lrp", preset="chefer2021", tuning=END)
    ref = relprop.explain(model, x, target=Liar(), method="lrp", preset="chefer2021", tuning=AS_NEEDED)
    assert any("at most 1 of its positions" in n for n in exp.notes)
    torch.testing.assert_close(exp.input_relevance, ref.input_relevance, rtol=1e-6, atol=1e-9)


def test_deferred_checks_raise_the_users_error_not_what_it_caused():
    model, x, _ = _case("bert")
    bad = dict(x)
    bad["input_ids"] = x["input_ids"].clone()
    bad["input_ids"][0, 2] = 10 ** 6
    with pytest.raises(relprop.InputError, match="token id 1000000, outside the model's vocabulary"):
        relprop.explain(model, bad, target=1, tuning=END)
    with pytest.raises(relprop.TargetError, match=r"target \[7, 7\] out of range"):
        relprop.explain(model, x, target=7, tuning=END)
    nan = models.image_batch(_case("vit")[0])
    nan[1, 0, 3, 3] = float("nan")
    with pytest.raises(relprop.InputError, match=r"NaN values \(sample\(s\) \[1\]\)"):
        relprop.explain(_case("vit")[0], nan, target=1, tuning=END)
