"""The host side of a kernel call: what is planned once and reused, and what a call launches.

A model calls the op with the same pattern and shapes in every layer of every step, so the
launchers keep each call's launch list (``kernels._calls._CALLS``), the default positions are made
once (``inputs._arange_row``), and eager calls skip the custom-op dispatcher
(``ops._EagerKernels``).
Each reuse must give exactly what planning afresh gives, and a different pattern, shape, dtype
or device must plan anew (``examples/benchmarks/host_overhead.py`` measures the gain).
"""

import pytest
import torch

import hf_hilbert_attn.kernels as kernels
import hf_hilbert_attn.kernels._config as kconfig
from hf_hilbert_attn.kernels import _bwd, _calls, _fwd
from hf_hilbert_attn import DilatedPattern, dilated_attention
from hf_hilbert_attn import ops
from hf_hilbert_attn.inputs import check_inputs
from hf_hilbert_attn.tools import aot

PATTERN = DilatedPattern([16, 32, 64], [1, 2, 4], sink_tokens=1)

# Tests that run the kernels on CPU tensors: through Triton's interpreter, which conftest.py
# turns on only where there is no GPU (on a GPU machine the kernels refuse CPU tensors).
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="kernels on CPU tensors: Triton's interpreter, off on a "
                                        "GPU machine")


def _launches(pattern, s=80, d=16, device="cpu", dtype=torch.float32, hq=4, hkv=2):
    """The recorded launches of one forward + backward, as comparable values (tensors by shape,
    strides, dtype and device)."""
    q = torch.empty(1, hq, s, d, device=device, dtype=dtype)
    k = torch.empty(1, hkv, s, d, device=device, dtype=dtype)
    calls = aot.launches(q, k, k, pattern)

    def value(x):
        if isinstance(x, torch.Tensor):
            small = x.device.type == "cpu" and x.dtype == torch.int32 and x.numel() <= 64
            return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device.type,
                    tuple(x.tolist()) if small else None)  # launch rows, configs: by content
        if isinstance(x, tuple):  # Strided / Positions: tensors with their strides
            return tuple(value(y) for y in x)
        return x
    return [(getattr(fn, "__name__", repr(fn)), grid, [value(a) for a in args],
             sorted(kwargs.items())) for fn, grid, args, kwargs in calls]


def test_launch_lists_reused_exactly_and_planned_anew_per_call_kind():
    _calls._CALLS.clear()
    first = _launches(PATTERN)
    planned = dict(_calls._CALLS)
    assert len(planned) == 2  # one forward, one backward list
    again = _launches(PATTERN)
    assert again == first
    assert _calls._CALLS.keys() == planned.keys()
    assert all(_calls._CALLS[key] is planned[key] for key in planned)  # reused, not rebuilt
    _calls._CALLS.clear()
    assert _launches(PATTERN) == first  # planned afresh: the same launches

    other = DilatedPattern([16, 32, 64], [1, 2, 8], sink_tokens=1)
    variants = [_launches(other), _launches(PATTERN, s=96), _launches(PATTERN, d=32),
                _launches(PATTERN, dtype=torch.float16), _launches(PATTERN, hq=2)]
    for v in variants:
        assert v != first
    assert len(_calls._CALLS) == 2 * (1 + len(variants))


def test_launch_lists_per_device():
    _calls._CALLS.clear()
    cpu = _launches(PATTERN)
    meta = _launches(PATTERN, device="meta")
    assert len(_calls._CALLS) == 4
    # the same plan on another device, with its small tables (configs) on that device
    assert [c[:2] for c in cpu] == [c[:2] for c in meta]
    for key, entry in _calls._CALLS.items():
        dev = key[15].type
        def tensors(x):
            if isinstance(x, torch.Tensor):
                return [x]
            return [t for y in x for t in tensors(y)] if isinstance(x, (tuple, list)) else []
        tables = tensors(entry)  # configs, union keys, launch rows
        assert tables and all(t.device.type == dev for t in tables), (key, tables)


def test_tiles_follow_the_gpu_shared_memory():
    """Head size 128 in 16-bit: the dk/dv tile of a GPU with 99 KiB per program is smaller."""
    d, dt = 128, torch.bfloat16
    # the GPU tiles, whatever runs these tests
    with kernels.configured(blocks=None, interpret=False):
        big = _calls._blocks("dkdv", d, dt, aot.SHARED_LIMIT[90])
        small = _calls._blocks("dkdv", d, dt, aot.SHARED_LIMIT[86])
        assert big == _calls._blocks("dkdv", d, dt, None)
        assert small != big and small[0] * small[1] < big[0] * big[1]
        assert _calls._blocks("dkdv", 64, dt, aot.SHARED_LIMIT[86]) == \
            _calls._blocks("dkdv", 64, dt, None)
        # dq: the third stage of launches without the pair mask needs more than 99 KiB
        for pair in (False, True):
            assert _calls._blocks("dq", d, dt, aot.SHARED_LIMIT[86], pair)[3] == 2
        assert _calls._blocks("dq", d, dt, None, False) == \
            _calls._blocks("dq", d, dt, aot.SHARED_LIMIT[90], False)


def test_default_positions_made_once_per_length_and_device():
    q = torch.empty(1, 2, 24, 16)
    a, b = check_inputs(q, q, q, PATTERN), check_inputs(q, q, q, PATTERN)
    assert a.k_positions is b.k_positions and a.q_positions is b.q_positions
    assert torch.equal(a.k_positions, torch.arange(24)[None])
    c = check_inputs(q[:, :, :10], q, q, PATTERN)  # queries at the last 10 positions
    assert torch.equal(c.q_positions, torch.arange(14, 24)[None])
    d = check_inputs(q.to("meta"), q.to("meta"), q.to("meta"), PATTERN)
    assert d.k_positions.device.type == "meta"


@pytest.fixture
def small_tiles():
    old = kernels.configure(blocks=(16, 16))
    yield
    kernels.configure(old)


@INTERPRETED
def test_a_layout_is_checked_and_routed_once(small_tiles, monkeypatch):
    """Eager calls at the default positions: the first of a layout checks and routes, the next
    go straight to the kernels with the same result; explicit positions, another dtype,
    pattern or length, or the interpreter turned off are checked again (a mixed-dtype call
    still raises after a clean one of the same shapes)."""
    ops._PREPARED.clear()
    checks, real = [], ops.check_inputs
    monkeypatch.setattr(ops, "check_inputs", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    s, d = 45, 16
    q, k, v = (torch.randn(1, h, s, d) for h in (4, 2, 2))
    first = dilated_attention(q, k, v, PATTERN, backend="triton")
    again = dilated_attention(q, k, v, PATTERN, backend="triton")
    assert len(checks) == 1 and torch.equal(first, again)
    at = torch.arange(s)
    assert torch.equal(dilated_attention(q, k, v, PATTERN, backend="triton", q_positions=at,
                                         k_positions=at), first)
    with pytest.raises(ValueError, match="share a dtype"):
        dilated_attention(q, k.double(), v, PATTERN, backend="triton")
    dilated_attention(q, k, v, DilatedPattern([16, 32], [1, 2]), backend="triton")
    dilated_attention(q[:, :, :40], k[:, :, :40], v[:, :, :40], PATTERN, backend="triton")
    assert len(checks) == 5
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA"):
        dilated_attention(q, k, v, PATTERN, backend="triton")


@INTERPRETED
def test_a_prepared_call_follows_the_kernels_configuration(small_tiles, monkeypatch):
    """``kernels.configure`` after a call was prepared: the next calls launch the new tiles,
    forward and backward, with the same result; the old configuration back, the old tiles."""
    ops._PREPARED.clear()
    tiles, real = [], kconfig._run
    for module in (_fwd, _bwd):
        monkeypatch.setattr(module, "_run", lambda launches, *a: tiles.append(
            {(ln[0].__name__, ln[4].get("BM"), ln[4].get("BN")) for ln in launches
             if "BN" in ln[4]}) or real(launches, *a))
    q, k, v = (torch.randn(1, h, 45, 16, requires_grad=True) for h in (4, 2, 2))

    def call():
        out = dilated_attention(q, k, v, PATTERN, backend="triton")
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        return [out.detach(), *grads], tiles[-2] | tiles[-1]

    first, small = call()
    with kernels.configured(blocks=(32, 16)):
        other, larger = call()
    again, back = call()
    assert len(ops._PREPARED) == 1 and {t[1:] for t in small} == {(16, 16)}
    assert {t[1] for t in larger} == {32} and {t[0] for t in larger} == {t[0] for t in small}
    assert back == small
    for x, y, z in zip(first, other, again):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)  # (float32 sums of other tiles)
        assert torch.equal(x, z)


@INTERPRETED
@pytest.mark.parametrize("autocast,by_layer", [(False, False), (True, False), (False, True)],
                         ids=["plain", "autocast", "by_layer"])
def test_the_layers_of_a_forward_run_its_prepared_call(small_tiles, monkeypatch, autocast,
                                                       by_layer):
    """In a model, once a layer's call was checked and routed (``ops._PREPARED``), the layers of
    a forward that call alike run the prepared call straight from the attention function, under
    autocast too (float32 weights, q and k float32 after the rotary embedding: cast once at the
    attention function, as the op casts), and where layers differ (dense heads by layer) the
    layers of one pattern; the loss and every gradient are bit for bit those of the checked
    calls; inputs or arguments that differ (dtype, shape, scale, soft cap) do not fit it."""
    import hf_hilbert_attn.integrations.transformers as hf
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_hilbert_attn import configure, set_dense_kv_heads

    cfg = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    model = configure(LlamaForCausalLM(cfg), PATTERN)
    if by_layer:  # layers 2 and 3 have the patterns of 0 and 1
        set_dense_kv_heads(model, [[0], [1], [0], [1]])
    # the kernels on CPU tensors for backend="auto" (through the interpreter), as on a GPU
    monkeypatch.setattr(ops, "use_triton", lambda q, a, backend: backend != "torch")
    runs, real = [], ops._Kernels.__call__
    monkeypatch.setattr(ops._Kernels, "__call__", lambda *a: runs.append(1) or real(*a))
    ids = torch.randint(0, 100, (2, 40))

    dtype = torch.float16 if autocast else torch.float32  # (the interpreter's dot: not bf16)

    def step():
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    ops._PREPARED.clear()
    first, again = step(), step()
    # layers 2-3, then 1-3: layer 0 prepares the forward's call (by layer: none, then 2-3,
    # layers 0 and 1 preparing their patterns' calls)
    assert len(runs) == (2 if by_layer else 2 + 3)
    monkeypatch.setattr(hf, "prepared", lambda *a, **kw: None)  # every layer checked
    plain = step()
    assert len(runs) == (2 if by_layer else 5)
    for x, y, z in zip(first, again, plain):
        assert torch.equal(x, y) and torch.equal(x, z)
    prep = next(iter(ops._PREPARED.values()))
    q = torch.empty(2, 4, 40, 16, dtype=dtype)
    assert prep.fits(q, q[:, :2], q[:, :2]) and prep.fits(q, q[:, :2], q[:, :2], 0.25)
    for other in ((q.double(), q[:, :2], q[:, :2]), (q, q[:, :2], q[:, :2], 0.3),
                  (q, q[:, :2], q[:, :2], None, 30.0), (q[:, :2], q[:, :2], q[:, :2])):
        assert not prep.fits(*other)  # another dtype, scale, soft cap or shape


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_layers_where_the_pattern_is_dense_run_the_prepared_sdpa_call(monkeypatch, autocast):
    """Where the pattern allows every pair at the model's length (the default pattern up to
    2K tokens), the op's route is SDPA: a forward's later layers run that prepared call straight
    from the attention function, under autocast too, with the loss and every gradient bit for
    bit those of layers that each check and route their call."""
    import hf_hilbert_attn.integrations.transformers as hf
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_hilbert_attn import configure

    cfg = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    model = configure(LlamaForCausalLM(cfg), DilatedPattern([64], [1], sink_tokens=1))
    runs, real = [], ops._Sdpa.run
    monkeypatch.setattr(ops._Sdpa, "run", lambda *a: runs.append(1) or real(*a))
    ops_calls, real_op = [], hf.dilated_attention
    monkeypatch.setattr(hf, "dilated_attention",
                        lambda *a, **kw: ops_calls.append(1) or real_op(*a, **kw))
    ids = torch.randint(0, 100, (2, 40))

    def step():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    ops._PREPARED.clear()
    first, again = step(), step()
    # every layer on SDPA; the op called by layers 0 and 1 of the first forward (the second
    # finds the first's call prepared), then by layer 0 alone
    assert len(runs) == 8 and len(ops_calls) == 3
    monkeypatch.setattr(hf, "prepared", lambda *a, **kw: None)  # every layer checked
    plain = step()
    assert len(runs) == 12 and len(ops_calls) == 7
    for x, y, z in zip(first, again, plain):
        assert torch.equal(x, y) and torch.equal(x, z)


@INTERPRETED
@pytest.mark.parametrize("use_lse", [False, True])
def test_eager_path_equals_the_custom_op(small_tiles, monkeypatch, use_lse):
    """The eager autograd Function and the custom ops (what torch.compile traces) give the same
    outputs and gradients, bit for bit; an unused lse sends no gradient (no zero tensor)."""
    s, d = 45, 16
    q = torch.randn(1, 4, s, d, requires_grad=True)
    k = torch.randn(1, 2, s, d, requires_grad=True)
    v = torch.randn(1, 2, s, d, requires_grad=True)
    do, dl = torch.randn(1, 4, s, d), torch.randn(1, 4, s)
    seen = []
    ops._PREPARED.clear()  # (a prepared call keeps the runner it made)
    real = kernels.bwd_runner  # (both paths run the kernels' backward through a runner)

    def spy(*args, **kwargs):
        run = real(*args, **kwargs)

        def spied(do, q, k, v, out, lse, dlse=None, *rest):
            seen.append(dlse is None)
            return run(do, q, k, v, out, lse, dlse, *rest)
        return spied

    for module in (kernels, _bwd):  # (the prepared call's runners, dilated_bwd's)
        monkeypatch.setattr(module, "bwd_runner", spy)
    results = []
    for eager in (True, False):
        monkeypatch.setattr(ops, "_eager", lambda e=eager: e)
        out, lse = dilated_attention(q, k, v, PATTERN, return_lse=True, backend="triton")
        loss = (out * do).sum() + ((lse * dl).sum() if use_lse else 0)
        results.append([out, lse, *torch.autograd.grad(loss, (q, k, v))])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert seen == [not use_lse, not use_lse]


def test_acc_bytes_and_compile_threads_from_the_environment(monkeypatch):
    monkeypatch.setenv("HF_HILBERT_ACC_BYTES", "536870912")
    assert kconfig._env_int("HF_HILBERT_ACC_BYTES", 7) == 536870912
    monkeypatch.delenv("HF_HILBERT_ACC_BYTES")
    assert kconfig._env_int("HF_HILBERT_ACC_BYTES", 7) == 7
    for bad in ("abc", "0", "-5", "1.5"):
        monkeypatch.setenv("HF_HILBERT_ACC_BYTES", bad)
        with pytest.raises(ValueError, match="HF_HILBERT_ACC_BYTES must be a positive number of "
                                             "bytes"):
            kconfig._env_int("HF_HILBERT_ACC_BYTES", 7)
    monkeypatch.setenv("HF_HILBERT_COMPILE_THREADS", "x")
    with pytest.raises(ValueError, match="HF_HILBERT_COMPILE_THREADS must be a positive number "
                                         "of threads"):
        kconfig._env_int("HF_HILBERT_COMPILE_THREADS", 4, "threads")


def test_compile_together_leaves_a_callers_async_mode_alone():
    # Triton's AsyncCompileMode does not nest: inside a caller's own mode the launchers compile
    # at launch instead of opening theirs
    from concurrent.futures import ThreadPoolExecutor

    import triton

    assert not kconfig._async_active()
    with ThreadPoolExecutor(1) as pool, triton.AsyncCompileMode(pool):
        assert kconfig._async_active()
    assert not kconfig._async_active()


def test_relaunch_guard_sees_what_triton_specializes_on():
    # kernels/_launch.py relaunches a compiled kernel while the guard of its arguments is
    # unchanged: it must differ wherever Triton would pick another specialization (dtype,
    # 16-byte alignment, integer values, bool vs int) and agree for new data of the same layout
    from hf_hilbert_attn.kernels._common import Strided
    from hf_hilbert_attn.kernels._launch import _addresses

    def _guard(args):
        return _addresses(args)[0]

    def args(t, *ints, flag=True):
        return (Strided(t, *ints), flag, 0.25, ((t, ints[0]), t))

    a = torch.randn(4, 64)
    same = _guard(args(a, 64, 16, 1))
    assert _guard(args(torch.randn(4, 64), 64, 16, 1)) == same
    assert _guard(args(a.view(-1)[4:], 64, 16, 1)) == same  # 16 bytes in: aligned again
    assert _guard(args(a.view(-1)[1:], 64, 16, 1)) != same  # 4 bytes in: not aligned
    assert _guard(args(a.half(), 64, 16, 1)) != same
    assert _guard(args(a, 64, 17, 1)) != same
    assert _guard(args(a, 64, 16, 1, flag=1)) != same
    # nesting does not hide a value: a tuple inside a tuple is guarded like its items
    assert _guard(((a, (a, 3)),)) == _guard((a, a, 3)) != _guard(((a, (a, 4)),))
    # what the launcher gets instead of the tensors: their addresses, in the same nesting
    b = a.view(-1)[1:]
    assert _addresses(args(b, 64, 16, 1)) == (
        _guard(args(b, 64, 16, 1)), ((b.data_ptr(), 64, 16, 1), True, 0.25,
                                     ((b.data_ptr(), 64), b.data_ptr())))
    assert b.data_ptr() == a.data_ptr() + 4


def test_a_planned_call_binds_once_per_layout_then_relaunches(monkeypatch):
    # kernels/_launch.py: a call's first launch of a layout binds each kernel through Triton
    # and keeps it by the guard of the call's heads (one lookup per call); a call with new
    # tensors of that layout hands the compiled kernels their addresses, each launch its own
    # head and grid, in order; a head whose guard differs (alignment, a stride) binds again.
    # Triton's side is stood in for (no GPU here): JITFunction.run returns a kernel that records.
    from triton.runtime.jit import JITFunction

    from hf_hilbert_attn.kernels import _launch
    from hf_hilbert_attn.kernels._common import Strided

    calls = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def __init__(self, name):
            self.name = name

        def run(self, *args):
            calls.append(("relaunch", self.name, args[:4], args[9:]))

        def launch_metadata(self, *args):
            return None

    def first(x, y, n, BLOCK):
        pass

    def second(x, n, BLOCK):
        pass

    fns = [JITFunction(first), JITFunction(second)]
    for fn in fns:
        monkeypatch.setattr(fn, "run", lambda *a, grid, warmup, name=fn.__name__, **kw:
                            calls.append(("bind", name, grid)) or Compiled(name))

    class Driver:  # the current device and stream
        active = type("A", (), dict(get_current_device=lambda self: 0,
                                    get_current_stream=lambda self, dev: "stream"))()

    monkeypatch.setattr(_launch, "driver", Driver)
    monkeypatch.setattr(_launch, "fast_launches_enabled", lambda: True)

    def launches(t, u):
        h1, h2 = (Strided(t, 16, 1, 1), Strided(u, 32, 1, 1)), (Strided(u, 32, 1, 1),)
        return [(fns[0], (2,), h1, (7,), dict(BLOCK=16)),
                (fns[1], (3, 5), h2, (8,), dict(BLOCK=32)),
                (fns[0], (4,), h1, (9,), dict(BLOCK=16))]

    memo, t, u = {}, torch.zeros(64), torch.zeros(64)
    assert _launch.launch_all(launches(t, u), memo) is not None
    assert [c[:3] for c in calls] == [("bind", "first", (2,)), ("bind", "second", (3, 5)),
                                      ("bind", "first", (4,))] and len(memo) == 1
    calls.clear()
    t, u = torch.zeros(64), torch.zeros(64)  # new tensors, the same layout
    _launch.launch_all(launches(t, u), memo)
    ptr = lambda x, s: (x.data_ptr(), s, 1, 1)  # noqa: E731
    assert calls == [("relaunch", "first", (2, 1, 1, "stream"), (ptr(t, 16), ptr(u, 32), 7, 16)),
                     ("relaunch", "second", (3, 5, 1, "stream"), (ptr(u, 32), 8, 32)),
                     ("relaunch", "first", (4, 1, 1, "stream"), (ptr(t, 16), ptr(u, 32), 9, 16))]
    for other in (torch.zeros(65)[1:], torch.zeros(64)[4:]):  # 4 bytes in: binds; 16: does not
        calls.clear()
        _launch.launch_all(launches(t, other), memo)
        assert [c[0] for c in calls] == ["bind" if other.data_ptr() % 16 else "relaunch"] * 3
    assert len(memo) == 2
    calls.clear()
    launch = launches(t, u)
    launch[1] = (fns[1], (3, 5), (Strided(u, 48, 1, 1),), (8,), dict(BLOCK=32))  # a stride
    _launch.launch_all(launch, memo)
    assert [c[0] for c in calls] == ["bind"] * 3 and len(memo) == 3
    calls.clear()
    assert _launch.launch_all(launches(t, u), None) is None  # no memo: every launch binds
    assert [c[0] for c in calls] == ["bind"] * 3


def test_a_relaunch_hands_triton_its_launch_hooks_only_where_one_is_set(monkeypatch):
    # Triton keeps its launch hooks as a chain (never None): an empty one goes to the launcher
    # as None, with no launch metadata built for it; a hook set (a profiler's) is passed on
    from triton import knobs

    from hf_hilbert_attn.kernels import _launch

    got = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def run(self, *args):
            got.append(args[6:9])  # launch metadata, enter hook, exit hook

        def launch_metadata(self, grid, stream, *values):
            return ("metadata", values)

    def hook(metadata):
        pass

    chain = type(knobs.runtime.launch_enter_hook)
    empty = chain() if hasattr(chain(), "calls") else None
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", empty)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", empty)
    _launch.relaunch(Compiled(), (1, 1, 1), (5, 6), stream=0)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    _launch.relaunch(Compiled(), (1, 1, 1), (5, 6), stream=0)
    assert got == [(None, None, None), (("metadata", (5, 6)), hook, None)]
    if empty is not None:  # a chain with a hook in it is passed as it is
        empty.add(hook)
        assert _launch._hook(empty) is empty


def test_a_relaunch_calls_the_launchers_c_function_as_the_launcher_would(monkeypatch):
    # Triton 3.6's launcher object only adds its flags and scratch memory (none here) before
    # calling its C function: a relaunch with no hook set calls that function with exactly
    # the arguments the launcher would pass it; a hook, scratch memory or another Triton
    # takes the launcher itself
    from triton import knobs

    from hf_hilbert_attn.kernels import _launch

    got = []

    class CudaLauncher:  # as Triton 3.6's: __call__ adds the flags and the scratch memory
        launch_cooperative_grid, launch_pdl = 0, 1

        def __init__(self, scratch):
            self.global_scratch_size = self.profile_scratch_size = scratch

        def launch(self, *args):
            got.append(("C", args))

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            got.append(("launcher",))
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                        self.launch_pdl, None, None, *args)

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def __init__(self, scratch=0):
            self.run = CudaLauncher(scratch)

        def launch_metadata(self, grid, stream, *values):
            return ("metadata", values)

    chain = type(knobs.runtime.launch_enter_hook)
    empty = chain() if hasattr(chain(), "calls") else None
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", empty)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", empty)
    monkeypatch.setattr(_launch, "_TRITON_36", True)
    kernel = Compiled()
    for _ in range(2):  # (the second from what the first found)
        _launch.relaunch(kernel, (2, 3, 1), (5, 6), stream=7)
    kernel.run(2, 3, 1, 7, "function", "metadata", None, None, None, 5, 6)  # what it would pass
    assert got[0] == got[1] == got[3] and got[2] == ("launcher",) and got[0][0] == "C"
    got.clear()
    _launch.relaunch(Compiled(scratch=64), (2, 3, 1), (5, 6), stream=7)
    monkeypatch.setattr(_launch, "_TRITON_36", False)
    _launch.relaunch(Compiled(), (2, 3, 1), (5, 6), stream=7)
    monkeypatch.setattr(_launch, "_TRITON_36", True)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    _launch.relaunch(kernel, (2, 3, 1), (5, 6), stream=7)
    assert [g[0] for g in got] == ["launcher", "C"] * 3
    assert got[-1][1][10] == ("metadata", (5, 6))  # (the hook's launch metadata)


def test_a_backward_launches_dq_and_dkdv_only():
    # no delta pass: the dq launches compute and write delta (with the lse gradient's flag only
    # where one is given), the first of two zeroes the sink keys' sums; a call whose one launch
    # takes the sink keys has its sums start from zeros instead
    launches = []
    old = kernels.set_launch_hook(launches.extend)
    try:
        for pattern, dlse in ((PATTERN, None), (PATTERN, True),
                              (DilatedPattern([64], [1], window="sliding", sink_tokens=1), None)):
            q, k = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16)
            a = check_inputs(q, k, k, pattern)
            plan, _ = kernels.plan_positions(a, pattern)
            out, lse = torch.randn_like(q), torch.randn(1, 4, 40)
            launches.clear()
            kernels.dilated_bwd(out, q, k, k, out, lse, lse if dlse else None, pattern, a.scale,
                                True, plan)
            names = [fn.__name__ if hasattr(fn, "__name__") else fn.fn.__name__
                     for fn, *_ in launches]
            n = len(_calls._launches(pattern, plan, True)[1])
            assert names == ["_dq_kernel"] * n + ["_dkdv_kernel"] * n, names
            assert all(kw["F"].HAS_DLSE == bool(dlse) for fn, _, _, kw in launches[:n])
            bp = next(v[0] for key, v in _calls._CALLS.items()
                      if key[0] == "plan_bwd" and key[1] == pattern)
            assert bp.sinks == 1 and bp.zero_sinks == (n == 1), (n, bp.zero_sinks)
    finally:
        kernels.set_launch_hook(old)


def test_a_backward_keeps_its_launches_apart_with_and_without_an_lse_gradient(monkeypatch):
    # dq compiles with and without an lse gradient while the heads' guards are the same (a
    # float32 tensor either way): launch_all's memo must be another one for each, or a call
    # with an lse gradient after one without would relaunch the kernel that ignores it.
    memos = []
    monkeypatch.setattr(_bwd, "_run", lambda run, fresh, cfg, memo=None: memos.append(memo))
    q, k = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16)
    a = check_inputs(q, k, k, PATTERN)
    plan, _ = kernels.plan_positions(a, PATTERN)
    out, lse, g = torch.randn_like(q), torch.randn(1, 4, 40), torch.randn_like(q)
    for dlse in (None, torch.randn(1, 4, 40), None, torch.randn(1, 4, 40)):
        kernels.dilated_bwd(g, q, k, k, out, lse, dlse, PATTERN, a.scale, True, plan)
    assert memos[0] is memos[2] and memos[1] is memos[3] and memos[0] is not memos[1]
    assert all(isinstance(m, dict) for m in memos)


@INTERPRETED
def test_dispatch_traces_into_one_graph():
    # torch.compile(fullgraph=True) traces the dispatch rule (backends.use_triton): a call dynamo
    # cannot trace there (e.g. __import__) breaks every compiled model's graph
    from hf_hilbert_attn.backends import select_backend

    q = torch.randn(1, 4, 45, 16)
    k = torch.randn(1, 2, 45, 16)
    a = check_inputs(q, k, k, PATTERN)

    def f(x):
        return x * 2 if select_backend(x, a, "triton").name == "triton" else x

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="eager")(q)
    assert torch.equal(out, q * 2)


def test_a_runner_relaunches_a_call_like_its_last_with_what_the_guard_gives(monkeypatch):
    # kernels.fwd_runner / bwd_runner: a call whose tensors have the last call's strides (and
    # are 16-byte aligned) relaunches the kernels that call kept, building the heads' values
    # itself. They must equal what launch_all's guarded path hands the same kernels for the
    # same tensors (another runner of the call: the plan's memo, no binding), launch by launch,
    # for every head (delta pass, dq and dk/dv, sink keys, dense heads); a call with another
    # stride or an unaligned tensor takes the guarded path. Triton is stood in for (no GPU).
    from triton.runtime.jit import JITFunction

    from hf_hilbert_attn.kernels import _launch

    calls, fast = [], []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def __init__(self, name):
            self.name = name

        def run(self, *args):
            calls.append((self.name, args[:3], args[9:]))

        def launch_metadata(self, *args):
            return None

    for module, name in ((_fwd, "_fwd_kernel"), (_bwd, "_dq_kernel"), (_bwd, "_dkdv_kernel")):
        fn = JITFunction(getattr(getattr(module, name), "fn", None) or getattr(module, name))
        monkeypatch.setattr(fn, "run", lambda *a, grid, warmup, n=name, **kw: Compiled(n))
        monkeypatch.setattr(module, name, fn)  # (Triton's interpreter has none to keep)

    class Driver:  # the current device and stream
        active = type("A", (), dict(get_current_device=lambda self: 0,
                                    get_current_stream=lambda self, dev: "stream"))()

    monkeypatch.setattr(_launch, "driver", Driver)
    monkeypatch.setattr(_launch, "fast_launches_enabled", lambda: True)
    real = _launch.relaunch_kept
    for module in (_fwd, _bwd):
        monkeypatch.setattr(module, "relaunch_kept", lambda *a: fast.append(1) or real(*a))
    pattern = DilatedPattern([16, 32, 64], [1, 2, 4], sink_tokens=2, dense_kv_heads=(1,))
    q, k = torch.randn(1, 4, 80, 16), torch.randn(1, 2, 80, 16)
    a = check_inputs(q, k, k, pattern)
    plan, _ = kernels.plan_positions(a, pattern)
    made = lambda: [torch.randn(1, 4, 80, 16), torch.randn(1, 2, 80, 16),  # noqa: E731
                    torch.randn(1, 2, 80, 16), torch.empty(1, 4, 80, 16), torch.empty(1, 4, 80)]

    def named(records, ts):  # addresses: the given tensors' by index, the others (the call's
        # buffers) numbered in the order they first appear
        names = {t.data_ptr(): i for i, t in enumerate(ts)}

        def name(x):
            if isinstance(x, tuple):
                return tuple(map(name, x))
            if isinstance(x, int) and x > 1 << 24:
                return names.setdefault(x, f"buffer {len(names)}")
            return x
        return [(n, g, name(vals)) for n, g, vals in records]

    for kind in ("fwd", "bwd"):
        runner = getattr(kernels, f"{kind}_runner")
        first = runner(q, k, pattern, plan, True, a.scale)

        def call(run, ts):
            if kind == "fwd":
                return run(*ts[:3], ts[3], ts[4])
            g, lse = torch.randn(1, 4, 80, 16), torch.randn(1, 4, 80)
            return run(g, *ts[:3], ts[3], lse, None, *made()[:3])

        call(first, made())  # binds and keeps
        ts = made()
        calls.clear(), fast.clear()
        call(first, ts)
        assert fast == [1], kind
        got = named(calls, ts)
        calls.clear()
        call(runner(q, k, pattern, plan, True, a.scale), ts)  # the guarded path
        assert len(fast) == 1 and got == named(calls, ts) and len(got) >= 3, kind
        odd = made()
        odd[0] = torch.randn(1 * 4 * 80 * 16 + 2)[2:].view(1, 4, 80, 16)  # 8 bytes in
        call(first, odd)
        odd[1] = torch.randn(1, 80, 2, 16).transpose(1, 2)  # another stride
        call(first, odd)
        assert len(fast) == 1, kind
        call(first, ts), call(first, ts)  # the layout kept again, then relaunched; with a
        # launch hook set, the hook gets the launches
        hooked, old = [], kernels.set_launch_hook(lambda launches: hooked.append(launches))
        try:
            call(first, ts)
        finally:
            kernels.set_launch_hook(old)
        assert len(fast) == 2 and len(hooked) == 1, kind


@INTERPRETED
def test_a_call_that_records_no_gradient_skips_the_autograd_function(small_tiles, monkeypatch):
    """A prepared call whose inputs need no gradient (``torch.no_grad``, inference mode, frozen
    inputs) runs the kernels' forward without the autograd Function, with the same bits; one
    that records a gradient goes through it."""
    s, d = 37, 16
    q, k, v = torch.randn(1, 4, s, d), torch.randn(1, 2, s, d), torch.randn(1, 2, s, d)
    applied, real = [], ops._EagerKernels.apply
    monkeypatch.setattr(ops._EagerKernels, "apply", lambda *a: applied.append(1) or real(*a))
    ops._PREPARED.clear()
    call = lambda *t: dilated_attention(*t, PATTERN, return_lse=True, backend="triton")
    with_grad = call(*(t.clone().requires_grad_() for t in (q, k, v)))  # prepares, then runs
    again = call(*(t.clone().requires_grad_() for t in (q, k, v)))
    assert len(applied) == 2
    with torch.no_grad():
        plain = call(q, k, v)
    with torch.inference_mode():
        inference = call(q, k, v)
    frozen = call(q, k, v)
    assert len(applied) == 2
    for got in (again, plain, inference, frozen):
        for a, b in zip(got, with_grad):
            assert torch.equal(a, b.detach())


def test_a_call_is_prepared_once_and_never_reenters_the_op(monkeypatch):
    """Autocast, dense heads split off the sparse heads (the PyTorch path) and the Hilbert
    layout are parts of one prepared call: the op is entered once per call and checks once per
    layout; under autocast it computes what it computes on inputs cast beforehand, bit for bit,
    and both the reference's function within the output's bfloat16 rounding."""
    from hf_hilbert_attn import reference_attention
    from helpers import assert_close

    entered, real = [], ops.dilated_attention
    monkeypatch.setattr(ops, "dilated_attention", lambda *a, **k: entered.append(1) or real(*a, **k))
    checks, real_check = [], ops.check_inputs
    monkeypatch.setattr(ops, "check_inputs", lambda *a, **k: checks.append(1) or real_check(*a, **k))
    ops._PREPARED.clear()
    p = DilatedPattern([8, 32], [1, 4], sink_tokens=1, ordering="hilbert", dense_kv_heads=[1])
    q, k, v = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = [ops.dilated_attention(q, k, v, p, return_lse=True) for _ in range(2)]
    assert len(entered) == 2 and len(checks) == 1
    call = next(iter(ops._PREPARED.values()))
    assert isinstance(call, ops._Split) and isinstance(call.sparse, ops._Permuted)
    cast = [t.bfloat16() for t in (q, k, v)]
    want = ops.dilated_attention(*cast, p, return_lse=True)
    for (out, lse), again in zip(got, [want, want]):
        assert out.dtype == torch.bfloat16 and torch.equal(out, again[0])
        assert torch.equal(lse, again[1])
    ref, ref_lse = reference_attention(*cast, p, return_lse=True, dtype=torch.float64)
    assert_close("out", got[0][0], ref, 2 ** -8)  # the output rounded once to bfloat16
    assert_close("lse", got[0][1], ref_lse, 1e-5)  # (float32 sums of 40 keys)
