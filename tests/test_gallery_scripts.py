"""The gallery scripts (docs/gallery/make_vit_gallery.py: the trained ViT; make_gallery.py: the demo's
text model) draw every registered method that applies to their model: a method added to the registry
and to neither a figure nor the script's list of excused methods fails here (the pictures are not
rebuilt: only the scripts' lists are read)."""
import importlib.util
import os

import pytest

import relprop

GALLERY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "gallery")


def _script(name):
    spec = importlib.util.spec_from_file_location(f"gallery_{name}", os.path.join(GALLERY, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name, excused", [("make_vit_gallery", "NOT_FOR_VIT"), ("make_gallery", "NOT_FOR_TEXT")])
def test_gallery_draws_every_registered_method(name, excused):
    script = _script(name)
    assert script.missing_methods() == []
    registered = set(relprop.methods())
    skipped = getattr(script, excused)
    assert set(skipped) <= registered  # an excuse for a method that no longer exists is stale
    assert all(isinstance(why, str) and len(why) > 20 for why in skipped.values())  # each says why


def test_gallery_missing_methods_sees_a_new_method(monkeypatch):
    script = _script("make_vit_gallery")
    fake = dict(relprop.methods())
    fake["brand_new_method"] = {}
    monkeypatch.setattr(script.relprop, "methods", lambda: fake)
    assert script.missing_methods() == ["brand_new_method"]


def test_text_gallery_draws_each_method_once_and_excuses_only_vit_cx():
    script = _script("make_gallery")
    assert len(script.METHODS) == len(set(script.METHODS))
    assert set(script.METHODS).isdisjoint(script.NOT_FOR_TEXT)
    assert set(script.NOT_FOR_TEXT) == {"vit_cx"}  # the one method that needs pixels on a patch grid
