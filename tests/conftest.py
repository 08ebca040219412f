import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

import models  # noqa: E402


@pytest.fixture(scope="session")
def zoo():
    """Each tiny model built once per test session (explain() must not modify them)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = {**models.VISION, **models.TEXT}[name]()
        return cache[name]

    return get


# Property tests explore new examples on every local run; under CI (CI=1, set by .ci/run) they
# replay a fixed sequence so that a landing is not decided by the draw.
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    _hyp_settings.load_profile("ci")
