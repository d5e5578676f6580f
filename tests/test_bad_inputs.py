"""A library call with a bad argument fails with one line that says what is wrong and what to
do instead (issue 37, item 6), not an error from deep inside Triton or an ``int()``. CPU."""

import pytest
import torch

import hf_hilbert_attn
from hf_hilbert_attn import DilatedPattern, patterns
from hf_hilbert_attn.backends import use_triton
from hf_hilbert_attn.inputs import check_inputs
from hf_hilbert_attn.tools.cli import main
from test_transformers import tiny_model

PATTERN = DilatedPattern([16, 64], [1, 4], window="sliding", sink_tokens=1)


def _qkv(s=40, d=32):
    return tuple(torch.randn(1, 2, s, d) for _ in range(3))


# ------------------------------------------------------------------ backend="triton" off CUDA
def test_triton_backend_on_cpu_without_the_interpreter_says_what_to_use(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest sets it on CPU machines
    q, k, v = _qkv()
    with pytest.raises(ValueError) as err:
        hf_hilbert_attn.dilated_attention(q, k, v, PATTERN, backend="triton")
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("backend='triton' needs CUDA tensors (got cpu)", "TRITON_INTERPRET=1",
                 "backend='auto' or 'torch'"):
        assert part in msg
    # the other backends take CPU tensors: "auto" is the PyTorch path there
    torch.testing.assert_close(hf_hilbert_attn.dilated_attention(q, k, v, PATTERN),
                               hf_hilbert_attn.reference_attention(q, k, v, PATTERN),
                               atol=1e-5, rtol=1e-5)


def test_triton_backend_on_cpu_under_the_interpreter_is_taken(monkeypatch):
    # how the tests run the kernels on CPU: the check reads the variable per call
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _qkv()
    assert use_triton(q, check_inputs(q, k, v, PATTERN), "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        use_triton(q, check_inputs(q, k, v, PATTERN), "triton")
    assert not use_triton(q, check_inputs(q, k, v, PATTERN), "auto")
    assert not use_triton(q, check_inputs(q, k, v, PATTERN), "torch")


# ------------------------------------------------------------------ set_dense_kv_heads
@pytest.fixture(scope="module")
def model():
    return hf_hilbert_attn.configure(tiny_model("llama"), PATTERN)  # 2 layers, 2 kv heads


@pytest.mark.parametrize("bad, match", [
    ([["a"], []], r"^layer 0: dense_kv_heads\[0\] must be an integer, got 'a'$"),
    ([[], [0.5]], r"^layer 1: dense_kv_heads\[0\] must be an integer, got 0\.5$"),
    ([[True], []], r"^layer 0: .*must be an integer, got True$"),
    ([[0], 1], r"^layer 1: dense key/value heads must be a list of head indices .*got 1$"),
    ([["01"], []], r"^layer 0: .*must be an integer, got '01'$"),
    (["01", []], r"^layer 0: dense key/value heads must be a list .*got '01'$"),
    ({1: 3}, r"^layer 1: dense key/value heads must be a list .*got 3$"),
    ([[-1], []], r"^layer 0: dense_kv_heads must be >= 0, got \[-1\]$"),
    ([[0, 0], []], r"^layer 0: dense_kv_heads must not repeat a head"),
    ([[2], []], r"^layer 0: .*head\(s\) \[2\], but the model has 2"),
    (5, r"^per_layer must be one list .*got 5$"),
])
def test_set_dense_kv_heads_names_the_layer_and_the_bad_value(model, bad, match):
    before = dict(model.config.hilbert_attn)
    with pytest.raises(ValueError, match=match):
        hf_hilbert_attn.set_dense_kv_heads(model, bad)
    assert model.config.hilbert_attn == before  # nothing written


def test_set_dense_kv_heads_still_takes_numpy_and_integral_values(model):
    np = pytest.importorskip("numpy")
    hf_hilbert_attn.set_dense_kv_heads(model, [[np.int64(1), 0.0], torch.tensor([1])])
    got = model.config.hilbert_attn["layer_dense_kv_heads"]
    assert got == [[0, 1], [1]] and all(type(j) is int for hs in got for j in hs)
    hf_hilbert_attn.set_dense_kv_heads(model, {1: (1, 0)})
    assert model.config.hilbert_attn["layer_dense_kv_heads"] == [[], [0, 1]]
    hf_hilbert_attn.set_dense_kv_heads(model, None)


# ------------------------------------------------------------------ inline sinks=K
def test_inline_negative_sinks_is_a_negative_count_not_an_unknown_option(capsys):
    spec = "256,1024:1,4:sliding:sinks=-1"
    with pytest.raises(ValueError) as err:
        patterns.as_pattern(spec)
    msg = str(err.value)
    assert "'sinks=-1' is a negative count of sink tokens; K must be >= 0" in msg
    assert "is not one of" not in msg and "\n" not in msg
    with pytest.raises(ValueError, match="'sinks=x' needs an integer count K >= 0"):
        patterns.parse_inline("256,1024:1,4:sinks=x")
    with pytest.raises(ValueError, match="option 'sink=1' is not one of sliding, segment"):
        patterns.parse_inline("256,1024:1,4:sink=1")  # a misspelt option still is one
    assert patterns.parse_inline("256,1024:1,4:sinks=0").sink_tokens == 0
    # the command line says the same, as its one error line
    with pytest.raises(SystemExit):
        main(["show-pattern", spec, "--length", "1k"])
    assert "is a negative count of sink tokens" in capsys.readouterr().err
