import os
import random

import pytest
import torch

# CPU machines run the real Triton kernels through the interpreter. This must be set before
# any @triton.jit function is defined, i.e. before hf_hilbert_attn.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random data per test, but reproducible from the printed seed on failure.
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield
