"""The fast path's fused Triton kernels (engine/fast/kernels.py) against the modules they replace.

Without a GPU the kernels run through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``):
the very kernel code the GPU runs, checked element by element against the HF modules, and end to
end (fast decode with every norm, q/k norm + rotary and SwiGLU fused == the eager path, token for
token, dense and hybrid). On a GPU the same checks run the compiled kernels on CUDA tensors.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("triton")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.draft import RMSNorm  # noqa: E402
from ddtree_diag.engine.fast import kernels  # noqa: E402
from ddtree_diag.engine.info import engine_info_rows  # noqa: E402
from ddtree_diag.engine.rope import apply_rope  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, record_calls, turn_kernels_on  # noqa: E402

pytestmark = MARKS


def norm_modules(size: int) -> dict:
    """One RMSNorm of each style, with non-trivial weights."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    made = {"qwen3": Qwen3RMSNorm(size, eps=1e-6), "qwen3_5": Qwen3_5RMSNorm(size, eps=1e-6)}
    made["draft"] = RMSNorm(size, 1e-5)
    generator = torch.Generator().manual_seed(size)
    with torch.no_grad():
        for style, module in made.items():
            centre = 0.0 if style == "qwen3_5" else 1.0  # the offset style scales by 1 + weight
            module.weight.copy_(torch.randn(size, generator=generator) * 0.3 + centre)
    return made


@pytest.fixture
def fused(monkeypatch):
    """Kernels on (CPU tensors too); returns the count of kernel calls by name."""
    turn_kernels_on(monkeypatch)
    module = kernels._triton()
    assert module is not None, "triton is installed but the kernel module did not import"
    calls: dict[str, int] = {}
    for name in ("rms_norm", "norm_rope", "silu_mul", "norm_rope_cache"):
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            if len(args) > 3 and args[3] is True:  # an offset-style (Qwen3.5 / Qwen3-Next) norm
                calls[f"{_name}_offset"] = calls.get(f"{_name}_offset", 0) + 1
            if kwargs.get("gate") is not None:
                calls["gated"] = calls.get("gated", 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: equal up to float rounding. bf16: the kernels round where the modules do, so only the
    variance sum's order (or a fast exp) can move an element across a rounding boundary: by one
    bf16 step at most, and rarely."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        return
    magnitude = want.float().abs()
    # a step of bf16 at the element's size (the tensor's mean size for elements near zero, where a
    # rotary sum cancels)
    step = torch.maximum(magnitude, magnitude.mean()) * 2**-7
    worst = ((got.float() - want.float()).abs() / step).max()
    differing = (got != want).float().mean()
    assert worst <= 1, f"{worst:.2f} bf16 steps off; {differing:.1%} of the elements differ"
    assert differing < 0.02, f"{differing:.1%} of the elements differ (at most {worst:.2f} steps)"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("size", (64, 96, 320))
def test_rms_norm_and_the_residual_add_equal_every_norm_style(fused, dtype, size):
    generator = torch.Generator().manual_seed(7)
    hidden = (torch.randn(1, 5, size, generator=generator) * 3).to(DEVICE, dtype)
    delta = torch.randn(1, 5, size, generator=generator).to(DEVICE, dtype)
    for style, module in norm_modules(size).items():
        module = module.to(DEVICE, dtype)
        assert_matches(kernels.rms_norm(module, hidden), module(hidden))
        total, normed = kernels.add_rms_norm(module, hidden, delta)
        assert torch.equal(total, hidden + delta), style  # the add rounds exactly like torch's
        assert_matches(normed, module(hidden + delta))
    assert fused["rms_norm"] == 6


def test_nan_stays_nan_and_fp16_runs_the_modules(fused):
    """A blow-up must show: a NaN in a row leaves that row NaN, as in the module (bf16 rounding
    by integer ops must not turn NaN into a number). fp16 is not fused."""
    module = norm_modules(64)["qwen3"].to(DEVICE, torch.bfloat16)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    x[1, 5] = float("nan")
    got, want = kernels.rms_norm(module, x), module(x)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[1].isnan().all())
    assert fused["rms_norm"] == 1
    half = norm_modules(64)["qwen3"].to(DEVICE, torch.float16)
    finite = x[[0, 2]].half()
    assert torch.equal(kernels.rms_norm(half, finite), half(finite))
    assert fused["rms_norm"] == 1


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_gated_output_norm_equals_the_gated_delta_net_modules(fused, dtype):
    """The Gated DeltaNet output norm: norm, weight, times silu(gate) (Qwen3.5 and Qwen3-Next)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    generator = torch.Generator().manual_seed(11)
    x = (torch.randn(37, 128, generator=generator) * 2).to(DEVICE, dtype)
    gate = (torch.randn(37, 128, generator=generator) * 3).to(DEVICE, dtype)
    for cls in (Qwen3_5RMSNormGated, Qwen3NextRMSNormGated):
        module = cls(128, eps=1e-6)
        with torch.no_grad():
            module.weight.copy_(torch.randn(128, generator=generator) * 0.3 + 1)
        module = module.to(DEVICE, dtype)
        assert_matches(kernels.gated_rms_norm(module, x, gate), module(x, gate))
        # the gate as the engine hands it over: [tokens, heads, head_dim], a column slice of a wider
        # projection output (x's rows are the tokens' heads in order), read in place
        wide = (torch.randn(12, 64 + 3 * 128, generator=generator) * 3).to(DEVICE, dtype)
        heads_gate = wide[:, 64:].view(12, 3, 128)  # token stride 448, head stride 128
        rows = x[:36]
        assert_matches(kernels.gated_rms_norm(module, rows, heads_gate), module(rows, heads_gate.reshape(36, 128)))
        one_token = wide[5:6, 64:].view(1, 3, 128)  # a one-row round's gate: its token stride is moot
        assert_matches(kernels.gated_rms_norm(module, x[:3], one_token), module(x[:3], one_token.reshape(3, 128)))
        # the plain entry points leave a gated norm alone (it needs its gate)
        assert kernels._norm_params(module, x) is None
    assert fused["rms_norm"] == 6


def test_a_gate_of_another_shape_is_refused(fused):
    x = torch.randn(6, 32, device=DEVICE)
    weight = torch.ones(32, device=DEVICE)
    for gate in (torch.randn(2, 3, 16, device=DEVICE), torch.randn(2, 2, 32, device=DEVICE)):
        with pytest.raises(ValueError):
            kernels._triton().rms_norm(x, weight, 1e-6, False, gate=gate)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("plan", ((1, 1), (2, 4), (8, 2), (16, 8)))
def test_rms_norm_launch_plans_give_the_same_result(fused, dtype, plan):
    """Rows per program and warps (``bench/norm_kernel_speed.py`` sweeps them) change only how the
    work is split: 37 rows, a partial last tile, every kind of norm (plain, residual add, gated)."""
    rows_per_program, num_warps = plan
    triton_kernels = kernels._triton()
    generator = torch.Generator().manual_seed(13)
    x = (torch.randn(37, 96, generator=generator) * 3).to(DEVICE, dtype)
    delta = torch.randn(37, 96, generator=generator).to(DEVICE, dtype)
    gate = (torch.randn(37, 96, generator=generator) * 3).to(DEVICE, dtype)
    weight = (torch.randn(96, generator=generator) * 0.3 + 1).to(DEVICE, dtype)
    for offset, extra in ((False, {}), (True, {"delta": delta}), (False, {"gate": gate})):
        want_normed, want_total = triton_kernels.rms_norm(x, weight, 1e-6, offset, **extra)
        got_normed, got_total = triton_kernels.rms_norm(
            x, weight, 1e-6, offset, **extra, rows_per_program=rows_per_program, num_warps=num_warps
        )
        assert torch.equal(got_total, want_total)  # the residual add: elementwise, exact
        if DEVICE == "cpu":  # the interpreter sums a row in one order whatever the split
            assert torch.equal(got_normed, want_normed), extra.keys()
        else:  # warps may change the variance sum's order
            assert_matches(got_normed, want_normed)
    assert fused["rms_norm"] == 6


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rotary", (16, 4))  # full rotary (Qwen3) and partial (Qwen3.5: a quarter)
def test_norm_rope_equals_the_norm_then_rotary_on_strided_heads(fused, dtype, rotary):
    """q and k as the fast path hands them over: views into one fused q|k|v output (row stride =
    the fused width), and a gated query (head stride = twice the head size)."""
    rows, heads, kv_heads, head_dim = 6, 4, 2, 16
    generator = torch.Generator().manual_seed(rotary)
    qkv = torch.randn(1, rows, (heads + 2 * kv_heads) * head_dim, generator=generator).to(DEVICE, dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    gated = torch.randn(1, rows, heads, 2 * head_dim, generator=generator).to(DEVICE, dtype).chunk(2, dim=-1)[0]
    positions = torch.arange(3, 3 + rows, dtype=torch.float32)[:, None]
    angles = positions * (1.0 / 10000 ** (torch.arange(0, rotary, 2) / rotary))
    emb = torch.cat([angles, angles], dim=-1)[None, None]
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    for style, module in norm_modules(head_dim).items():
        module = module.to(DEVICE, dtype)
        for x in (q.view(1, rows, heads, head_dim), k.view(1, rows, kv_heads, head_dim), gated):
            want = apply_rope(module(x).transpose(1, 2), cos, sin)
            got = kernels.norm_rope(module, x, cos, sin)
            assert_matches(got, want)
            assert got.shape == (1, x.shape[2], rows, head_dim), style
    for x in (q.view(1, rows, heads, head_dim), k.view(1, rows, kv_heads, head_dim), gated):
        assert_matches(kernels.rope(x, cos, sin), apply_rope(x.transpose(1, 2), cos, sin))  # no q/k norm
    assert fused["norm_rope"] == 12


class QKNorms(torch.nn.Module):
    """An attention module's q/k norms, as ``norm_rope_cache`` finds them."""

    def __init__(self, q_norm: torch.nn.Module, k_norm: torch.nn.Module) -> None:
        super().__init__()
        self.q_norm, self.k_norm = q_norm, k_norm


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rotary", (16, 4))
def test_norm_rope_cache_equals_two_norm_ropes_and_the_cache_write(fused, dtype, rotary):
    """q and k normed and turned, k and v written into the cache at start.. in one kernel: bit for
    bit what norm_rope twice and KVCache.write give (the same math, shared), for q/k/v as views of
    one fused q|k|v output, a gated query, and rotary alone; nothing else in the cache moves."""
    from ddtree_diag.engine.target import KVCache

    rows, heads, kv_heads, head_dim, capacity = 6, 4, 2, 16, 20
    generator = torch.Generator().manual_seed(rotary + 1)
    qkv = torch.randn(1, rows, (heads + 2 * kv_heads) * head_dim, generator=generator).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(1, rows, heads, head_dim), k.view(1, rows, kv_heads, head_dim), v.view(1, rows, kv_heads, head_dim)
    gated = torch.randn(1, rows, heads, 2 * head_dim, generator=generator).to(DEVICE, dtype).chunk(2, dim=-1)[0]
    positions = torch.arange(3, 3 + rows, dtype=torch.float32)[:, None]
    angles = positions * (1.0 / 10000 ** (torch.arange(0, rotary, 2) / rotary))
    emb = torch.cat([angles, angles], dim=-1)[None, None]
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    start = torch.tensor(5, device=DEVICE)
    slots = start + torch.arange(rows, device=DEVICE)
    calls = 0
    for style, module in [*norm_modules(head_dim).items(), ("rotary alone", None)]:
        attn = None if module is None else QKNorms(module, module).to(DEVICE, dtype)
        for query in (q, gated):
            want_cache = KVCache(2, kv_heads, head_dim, capacity, torch.device(DEVICE), dtype)
            got_cache = KVCache(2, kv_heads, head_dim, capacity, torch.device(DEVICE), dtype)
            for cache in (want_cache, got_cache):  # what was there before must stay
                cache.k.normal_(generator=None)
                cache.v.copy_(cache.k * 2)
            got_cache.k.copy_(want_cache.k)
            got_cache.v.copy_(want_cache.v)
            if attn is None:
                want_q, want_k = kernels.rope(query, cos, sin), kernels.rope(k, cos, sin)
            else:
                want_q = kernels.norm_rope(attn.q_norm, query, cos, sin)
                want_k = kernels.norm_rope(attn.k_norm, k, cos, sin)
            want_cache.write(1, slots, want_k, v.transpose(1, 2))
            got_q = kernels.norm_rope_cache(attn, query, k, v, cos, sin, got_cache.k[1], got_cache.v[1], start)
            calls += 1
            assert got_q is not None and torch.equal(got_q, want_q), style
            assert torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v), style
    assert fused["norm_rope_cache"] == calls


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("plan", ((1, 1), (2, 1), (4, 2), (16, 4)))
def test_norm_rope_cache_launch_plans_give_the_same_result(dtype, plan):
    """(row, head) pairs per program and warps (``bench/rope_kernel_speed.py`` sweeps them) change
    only how the work is split: 7 rows of 6 query heads and 2 KV heads (a partial last tile, q's
    pairs outnumbering k's), offset norms and a quarter of each head turned."""
    triton_kernels = kernels._triton()
    rows, heads, kv_heads, head_dim, rotary = 7, 6, 2, 32, 8
    generator = torch.Generator().manual_seed(17)
    qkv = (torch.randn(1, rows, (heads + 2 * kv_heads) * head_dim, generator=generator) * 2).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(1, rows, heads, head_dim), k.view(1, rows, kv_heads, head_dim), v.view(1, rows, kv_heads, head_dim)
    angles = torch.arange(9, 9 + rows, dtype=torch.float32)[:, None] * torch.rand(rotary // 2, generator=generator)
    cos, sin = (torch.cat([angles, angles], dim=-1).cos().to(DEVICE, dtype),
                torch.cat([angles, angles], dim=-1).sin().to(DEVICE, dtype))
    weight = (torch.randn(head_dim, generator=generator) * 0.2).to(DEVICE, dtype)
    start = torch.tensor(4, device=DEVICE)
    results = []
    for chosen in (None, plan):
        cache_k = torch.zeros(1, kv_heads, 16, head_dim, device=DEVICE, dtype=dtype)
        cache_v = torch.zeros_like(cache_k)
        out = triton_kernels.norm_rope_cache(
            q, k, v, True, (weight, 1e-6), (weight.flip(0).contiguous(), 1e-6), cos, sin, cache_k, cache_v, start,
            plan=chosen,
        )
        results.append((out, cache_k, cache_v))
    (want_q, want_k, want_v), (got_q, got_k, got_v) = results
    assert torch.equal(got_v, want_v) and want_v[:, :, 4 : 4 + rows].abs().sum() > 0  # v: copied as it is
    assert not want_k[:, :, :4].any() and not want_k[:, :, 4 + rows :].any()  # only slots start..
    if DEVICE == "cpu":  # the interpreter sums a head in one order whatever the split
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    else:  # warps may change the norm's sum order
        assert_matches(got_q, want_q)
        assert_matches(got_k, want_k)


def test_norm_rope_cache_declines_what_it_cannot_write(fused, monkeypatch):
    """A cache of another dtype, or the switch off: None, nothing written (the caller writes)."""
    rows, heads, kv_heads, head_dim = 3, 2, 1, 8
    q = torch.randn(1, rows, heads, head_dim, device=DEVICE)
    k = v = torch.randn(1, rows, kv_heads, head_dim, device=DEVICE)
    cos, sin = torch.ones(1, 1, rows, head_dim, device=DEVICE), torch.zeros(1, 1, rows, head_dim, device=DEVICE)
    start = torch.tensor(0, device=DEVICE)
    other = torch.zeros(1, kv_heads, 8, head_dim, device=DEVICE, dtype=torch.bfloat16)
    assert kernels.norm_rope_cache(None, q, k, v, cos, sin, other, other.clone(), start) is None
    cache = torch.zeros(1, kv_heads, 8, head_dim, device=DEVICE)
    monkeypatch.setenv("DDTREE_DIAG_QKV_KERNEL", "off")
    assert kernels.norm_rope_cache(None, q, k, v, cos, sin, cache, cache.clone(), start) is None
    assert not cache.any() and fused.get("norm_rope_cache", 0) == 0


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_silu_mul_equals_the_activation_times_up(fused, dtype):
    from transformers.activations import ACT2FN

    gate_up = (torch.randn(1, 7, 2 * 1100, generator=torch.Generator().manual_seed(3)) * 4).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    for act in (torch.nn.SiLU(), ACT2FN["silu"]):
        got = kernels.silu_mul(act, gate_up)
        assert_matches(got, act(gate) * up)
    # another activation is not fused: the module runs
    gelu = torch.nn.GELU()
    assert torch.equal(kernels.silu_mul(gelu, gate_up), gelu(gate) * up)
    assert fused["silu_mul"] == 2


def test_unknown_norms_and_mismatched_dtypes_run_the_module_itself(fused):
    class ScaledNorm(torch.nn.Module):  # an RMSNorm-looking module the kernels do not know
        def __init__(self):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.ones(8)), 1e-6

        def forward(self, x):
            return x * 2

    x = torch.randn(1, 3, 8, device=DEVICE)
    assert torch.equal(kernels.rms_norm(ScaledNorm().to(DEVICE), x), x * 2)
    promoted = norm_modules(8)["qwen3"].to(DEVICE)  # fp32 weight, bf16 input: the module's output is fp32
    assert kernels.rms_norm(promoted, x.bfloat16()).dtype == torch.float32
    assert fused.get("rms_norm", 0) == 0


def test_kernels_stay_off_where_the_setting_says(monkeypatch):
    module = norm_modules(8)["qwen3"]
    x = torch.randn(1, 2, 8)
    monkeypatch.setattr(kernels, "_triton", lambda: pytest.fail("kernels used"))
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "auto")  # auto: CUDA tensors only
    assert torch.equal(kernels.rms_norm(module, x), module(x))
    assert not kernels.active(torch.device("cpu"), torch.float32)
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "off")
    assert not kernels.available() and not kernels.active(torch.device("cuda"), torch.bfloat16)
    assert torch.equal(kernels.rms_norm(module, x), module(x))


# ---- whole rounds -----------------------------------------------------------------------------


def generate(engine, path, prompt, **kwargs):
    previous = engine.decode_path
    engine.use_path(path)
    try:
        return engine.generate_ids(prompt, stop_token_ids=[], max_tokens=12, **kwargs)
    finally:
        engine.use_path(previous)


@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
@pytest.mark.parametrize("model_type", ("qwen3", "llama", "hybrid"))
def test_folded_residual_and_cache_write_equal_the_unfolded_layer(fused, tmp_path, dtype, model_type):
    """A target attention layer as the fast rounds now run it: the previous MLP's residual added in
    the input norm's kernel, q/k norm + rotary and the K/V write in one kernel; bit for bit the
    layer as it ran before (add, norm, two norm_ropes, KVCache.write), in bf16 too. Qwen3 (q/k
    norms), Llama (rotary alone), Qwen3.5 (a gated query, offset norms, partial rotary)."""
    from ddtree_diag.engine.fast import layers as fast_layers
    from ddtree_diag.engine.fast.layers import FusedWeights

    if model_type == "hybrid":
        path = fx.make_hybrid_target(tmp_path / "t", pattern="LA")
    else:
        path = fx.make_target(tmp_path / "t", model_type=model_type)
    t = load_engine(path, device=DEVICE, dtype=dtype).target
    index = t.attention_layers[0]
    layer, rows = t.layers[index], 5
    fused_weights = FusedWeights.for_layer(layer)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, rows, t.hidden_size, generator=generator).to(DEVICE, t.dtype)
    residual = torch.randn(1, rows, t.hidden_size, generator=generator).to(DEVICE, t.dtype)
    cos, sin = t.rope(hidden, torch.arange(3, 3 + rows, device=DEVICE))
    start = torch.tensor(7, device=DEVICE)
    slot = t.cache_slot[index]
    shape, flags = (t.heads, t.kv_heads, t.head_dim), {"arch": t.arch}
    with torch.no_grad():
        t.kv.k.normal_()
        t.kv.v.normal_()
        before_k, before_v = t.kv.k.clone(), t.kv.v.clone()
        q, k, v, gate, total = fast_layers.target_pre_attention(
            layer, hidden + residual, cos, sin, *shape, fused_weights, **flags
        )
        t.kv.write(slot, start + torch.arange(rows, device=DEVICE), k, v)
        want_k, want_v = t.kv.k.clone(), t.kv.v.clone()
        t.kv.k.copy_(before_k)
        t.kv.v.copy_(before_v)
        got_q, got_k, got_v, got_gate, got_total = fast_layers.target_pre_attention(
            layer, hidden, cos, sin, *shape, fused_weights, **flags, residual=residual,
            cache=(t.kv.k[slot], t.kv.v[slot], start),
        )
        assert got_k is None and got_v is None  # written into the cache
        assert torch.equal(got_q, q) and torch.equal(got_total, total)
        assert (gate is None) == (got_gate is None) and (gate is None or torch.equal(got_gate, gate))
        assert torch.equal(t.kv.k, want_k) and torch.equal(t.kv.v, want_v)
        # the MLP half's residual left for the next norm: the same sum once added
        attn_out = torch.randn(1, rows, t.heads * t.head_dim, generator=generator).to(DEVICE, t.dtype)
        kept, delta = fast_layers.target_post_attention(layer, total, attn_out, fused_weights, gate, True, t.arch)
        assert torch.equal(
            kept + delta, fast_layers.target_post_attention(layer, total, attn_out, fused_weights, gate, arch=t.arch)
        )
        if gate is not None:
            # the gate as the eager forward applies it (contiguous, flat heads): bit for bit on the CPU
            assert gate.shape == (1, rows, t.heads, t.head_dim) and gate.is_contiguous() == (DEVICE == "cpu")
            flat = gate.reshape(1, rows, t.heads * t.head_dim)
            plain = fast_layers.mlp_half(layer, total, fused_weights, delta=layer.self_attn.o_proj(
                attn_out * torch.sigmoid(flat)), arch=t.arch)
            assert torch.equal(fast_layers.target_post_attention(
                layer, total, attn_out, fused_weights, gate, arch=t.arch), plain)
            # CUDA's strided view of the q projection: the same heads and columns (not the same
            # bits on a CPU, whose SIMD sigmoid ends each strided run with the scalar formula)
            strided = torch.cat([torch.zeros_like(gate), gate], dim=-1).chunk(2, dim=-1)[1]
            assert not strided.is_contiguous()
            torch.testing.assert_close(fast_layers.target_post_attention(
                layer, total, attn_out, fused_weights, strided, arch=t.arch), plain)
    assert fused["norm_rope_cache"] == 1


@pytest.mark.parametrize("model_type", ("qwen3", "llama", "gpt_oss", "smollm3", "gemma3_text", "olmo2", "phi3"))
def test_fused_fast_rounds_equal_eager_dense(fused, tmp_path, monkeypatch, model_type):
    """Every norm, q/k norm + rotary (Llama: rotary alone) and SwiGLU of the target and the draft
    through the kernels: the fast rounds still give the eager path's tokens and acceptance (fp32,
    T=0). gpt-oss: rotary on a head's halves through the one-kernel cache write, attention sinks
    beside it (SDPA), its MoE and norms as HF's modules. SmolLM3: its NoPE layers' identity rotary.
    Gemma 3: sandwich norms (offset style) and a rotary table per layer type. OLMo 2: post norms,
    q/k normed over all heads before the one-kernel rotary and cache write. Phi-3: its own q|k|v
    linear."""
    target = fx.make_target(tmp_path / "t", model_type=model_type)
    engine = load_engine(target, fx.make_draft(tmp_path / "d", block_size=4), device=DEVICE, dtype="fp32")
    written: set[int] = set()  # the storages the one-kernel K/V write wrote into
    module, counted = kernels._triton(), kernels._triton().norm_rope_cache

    def recording(*args, **kwargs):
        written.add(args[8].untyped_storage().data_ptr())
        return counted(*args, **kwargs)

    monkeypatch.setattr(module, "norm_rope_cache", recording)
    prompt = fx.PROMPTS[1]
    for budget in (0, 4, 16) if model_type == "qwen3" else (4,):
        eager = generate(engine, "eager", prompt, tree_budget=budget)
        quick = generate(engine, "fast-nograph", prompt, tree_budget=budget)
        assert (quick.token_ids, quick.acceptance_lengths) == (eager.token_ids, eager.acceptance_lengths), budget
        assert quick.extras["fused_kernels"] is True and "fused_kernels" not in eager.extras
    assert fused["rms_norm"] and fused["norm_rope"] and fused["silu_mul"]
    assert fused["norm_rope_cache"]  # the target's q/k norm + rotary and K/V write: one kernel
    decoder = engine.decoder("fast-nograph")
    # the target's cache and the draft's noise block both
    assert written == {engine.target.kv.k.untyped_storage().data_ptr(), decoder.draft_k.untyped_storage().data_ptr()}
    engine.use_path("fast-nograph")
    rows = dict(engine_info_rows(engine.info() | {"model": "m", "target_path": "t", "draft_path": "d"}))
    assert rows["decode path"] == "fast-nograph, fused Triton kernels"


def test_fused_fast_rounds_equal_eager_hybrid(fused, tmp_path, monkeypatch):
    """The same on a Qwen3.5-style hybrid (offset-style norms, a gated query, partial rotary, the
    Gated DeltaNet output norm); the draft's norms are of the other style, so the offset and gated
    counts come from the target's layers."""
    target = fx.make_hybrid_target(tmp_path / "t", pattern="LLAL")
    draft = fx.make_draft(tmp_path / "d", block_size=4, layer_ids=(0, 2), layers=1)
    engine = load_engine(target, draft, device=DEVICE, dtype="fp32")
    prompt = fx.PROMPTS[0]
    solve_norms = []  # row counts of the solves that were handed the output norm

    def note(conv_out, *_, out_norm=None, **__):
        if out_norm is not None:
            solve_norms.append(len(conv_out))

    record_calls(monkeypatch, kernels._triton_gdn(), "tree_solve", note)
    for budget in (0, 8):
        eager = generate(engine, "eager", prompt, tree_budget=budget)
        quick = generate(engine, "fast-nograph", prompt, tree_budget=budget)
        assert (quick.token_ids, quick.acceptance_lengths) == (eager.token_ids, eager.acceptance_lengths), budget
    assert fused["rms_norm"] and fused["norm_rope"] and fused["silu_mul"]
    # the target's attention layers: q/k norm + rotary and the K/V write in one kernel (a gated query)
    assert fused["rms_norm_offset"] and fused["norm_rope_cache_offset"]
    # the Gated DeltaNet output norm: by the norm kernel after a one-row solve (AR rounds), inside
    # the path solve at the tree's rows
    assert fused["gated"] and 1 in solve_norms and 9 in solve_norms
