"""``exp.show()`` in a real Jupyter kernel (nbclient executes a notebook, as a user's Jupyter would): an image
explanation's cell holds one ``image/png`` output and no ``<Figure ...>`` text, a text explanation's one
``text/html`` output, and neither cell returns a second copy of itself."""
import os

import nbformat
import pytest
from nbclient import NotebookClient

TESTS = os.path.dirname(os.path.abspath(__file__))
SETUP = f"""import sys, warnings
sys.path.insert(0, {TESTS!r})
warnings.simplefilter("ignore")
import models, relprop"""
IMAGE = """vit = models.timm_vit_tiny()
exp = relprop.explain(vit, models.image_batch(vit), target=1)
exp.show()"""
TEXT = """from relprop import demo
model, tok = demo.load()  # the shipped checkpoint, offline
exp = relprop.explain(model, tok(["The striker scored a late goal."], return_tensors="pt"), tokenizer=tok,
                      method="lrp")
exp.show()"""


@pytest.mark.slow  # starts a kernel and captures two models (about half a minute)
def test_show_in_a_notebook_displays_the_picture(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (SETUP, IMAGE, TEXT)])
    env = {**os.environ, "RELPROP_CACHE_DIR": "off", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    old = dict(os.environ)
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    _, image, text = nb.cells
    kinds = [sorted(o.get("data", {})) for o in image.outputs if o.output_type in ("display_data", "execute_result")]
    assert kinds == [["image/png", "text/plain"]], image.outputs  # one picture, shown once
    assert len(image.outputs[0]["data"]["image/png"]) > 1000  # a real PNG (base64), not an empty figure
    plain = [o["data"].get("text/plain", "") for o in image.outputs if "data" in o]
    assert not any(p.startswith("<Figure") for p in plain)
    html = [o for o in text.outputs if o.output_type in ("display_data", "execute_result")]
    assert len(html) == 1 and "text/html" in html[0]["data"] and "<span" in html[0]["data"]["text/html"]
    assert "striker" in html[0]["data"]["text/html"]  # the words, from the remembered tokenizer
    errors = [o for c in nb.cells for o in c.outputs if o.output_type == "error"]
    assert not errors
