"""Take a complete snapshot of a model's state to prove that explain() leaves it untouched."""
import torch


def snapshot(model: torch.nn.Module):
    state = {}
    for name, p in model.named_parameters():
        grad = None if p.grad is None else p.grad.clone()
        state["param:" + name] = (p.detach().clone(), p.requires_grad, grad, id(p))
    for name, b in model.named_buffers():
        state["buffer:" + name] = (b.detach().clone(), id(b))
    for name, m in model.named_modules():
        hooks = {}
        for attr in dir(m):
            if attr.startswith("_") and attr.endswith("hooks") and isinstance(getattr(m, attr, None), dict):
                hooks[attr] = list(getattr(m, attr).keys())
        state["module:" + name] = (m.training, type(m), hooks, sorted(m.__dict__.keys()))
    # (``__slotnames__`` is copyreg's cache, which copy.deepcopy adds to a class the first time it copies one
    # of its instances, e.g. the class torch.nn.utils.parametrize makes for Wav2Vec2's weight-normed conv)
    state["class_dicts"] = {t: sorted(k for k in vars(t).keys() if k != "__slotnames__")
                            for t in {type(m) for m in model.modules()}}
    state["sdpa"] = torch.nn.functional.scaled_dot_product_attention
    return state


def assert_same(before, after):
    assert before.keys() == after.keys()
    for k, v in before.items():
        w = after[k]
        if k.startswith("param:"):
            assert torch.equal(v[0], w[0]) and v[1] == w[1] and v[3] == w[3], k
            assert (v[2] is None) == (w[2] is None), f"{k}: .grad changed"
        elif k.startswith("buffer:"):
            assert torch.equal(v[0], w[0]) and v[1] == w[1], k
        else:
            assert v == w, k
