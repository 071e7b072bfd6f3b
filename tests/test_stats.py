import pytest
import torch

from quantkit.stats import InputCapture, InputStats, compute_dtype, fast_relative_error, hessian_norm, relative_error

FEATURES = 96
SHAPES = [(2, 40), (3, 17), (1, 64)]  # [batch, seq] of successive calibration batches


def _batches(seed=0):
    """Correlated inputs whose first position is 30x larger, like the attention-sink tokens P-GPTQ drops."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(FEATURES, FEATURES, generator=g) / 10
    batches = [torch.randn(b, s, FEATURES, generator=g) @ mixing for b, s in SHAPES]
    for x in batches:
        x[:, 0] *= 30
    return batches


def _direct_hessian(batches, skip_prefix=0):
    rows = torch.cat([x[:, skip_prefix:].reshape(-1, FEATURES) for x in batches]).double()
    return 2.0 / rows.shape[0] * rows.T @ rows, rows.shape[0]


def _accumulate(batches, skip_prefix=0, dtype=torch.float32):
    stats = InputStats(FEATURES, skip_prefix=skip_prefix)
    for x in batches:
        stats.add(x.to(dtype))
    return stats


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("skip_prefix", [0, 4])
def test_hessian_equals_direct_float64(skip_prefix):
    # skip_prefix=4 is the P-GPTQ definition: H built from X[:, 4:] of every sequence.
    batches = _batches()
    stats = _accumulate(batches, skip_prefix)
    expected, tokens = _direct_hessian(batches, skip_prefix)
    assert stats.tokens == tokens == sum(b * (s - skip_prefix) for b, s in SHAPES)
    assert stats.hessian.dtype == torch.float32
    assert (stats.hessian.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_prefix_positions_really_dropped():
    batches = _batches()
    with_prefix, without = _accumulate(batches, 0).hessian, _accumulate(batches, 4).hessian
    # The 30x first positions (6 of 195 tokens) dominate the full Hessian: its trace is 23x larger.
    assert with_prefix.trace() > 20 * without.trace()
    short = InputStats(FEATURES, skip_prefix=4)
    short.add(torch.randn(2, 4, FEATURES))  # nothing left after the prefix
    assert short.tokens == 0 and not short.hessian.any()


def test_bf16_inputs_give_the_float32_hessian_of_their_values():
    # The product is taken in fp32: only the inputs' own rounding to bf16 remains.
    batches = _batches()
    bf16 = _accumulate(batches, dtype=torch.bfloat16).hessian
    same_values = _accumulate([x.bfloat16().float() for x in batches]).hessian
    assert _relative(bf16, same_values) < 1e-6


def test_nearly_low_rank_bf16_inputs_stay_positive_definite_with_one_percent_damping():
    # Like attention outputs: 8 directions carry everything, plus a little noise. A bf16 product
    # (output rounded to 8 mantissa bits) made such a Hessian's lowest eigenvalue -6 % of its mean
    # diagonal on the default model's o_proj inputs.
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(4, 512, 8, generator=g) @ torch.randn(8, FEATURES, generator=g) * 10
         + 0.01 * torch.randn(4, 512, FEATURES, generator=g))
    stats = InputStats(FEATURES)
    stats.add(x.bfloat16())
    h = stats.hessian.double()
    lowest = torch.linalg.eigvalsh(h)[0].item()
    assert lowest > -1e-6 * h.diagonal().mean().item()


def test_relative_error_matches_direct_output_error():
    batches = _batches()
    hessian = _accumulate(batches).hessian
    x = torch.cat([b.reshape(-1, FEATURES) for b in batches]).double()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, FEATURES, generator=g)
    approx = w + 0.01 * torch.randn(32, FEATURES, generator=g)
    direct = ((w.double() - approx.double()) @ x.T).square().sum() / (w.double() @ x.T).square().sum()
    assert relative_error(w, approx, hessian) == pytest.approx(direct.item(), rel=1e-5)
    assert relative_error(w, w, hessian) == 0.0
    # bf16 products (AMX) for per-layer reports: within the 1e-3 hessian_norm documents
    assert fast_relative_error(w, approx, hessian) == pytest.approx(direct.item(), rel=1e-3)
    assert fast_relative_error(w, w, hessian) == 0.0


def test_hessian_norm_is_the_trace_across_row_blocks(monkeypatch):
    g = torch.Generator().manual_seed(2)
    hessian = _accumulate(_batches()).hessian
    m = torch.randn(300, FEATURES, generator=g)
    exact = torch.trace(m.double() @ hessian.double() @ m.double().T).item()
    whole = hessian_norm(m, hessian)
    monkeypatch.setattr("quantkit.stats._BLOCK_ELEMENTS", 7 * FEATURES)  # 43 blocks of 7 rows and one of 6
    assert hessian_norm(m, hessian) == pytest.approx(whole, rel=1e-6)
    assert whole == pytest.approx(exact, rel=1e-3)


def test_capture_adds_each_named_linears_inputs_and_can_stop_the_forward():
    """The hooks see what a forward gives each linear, batch after batch, as direct accumulation does;
    with ``stop_after_last`` the forward ends at the last named linear; the hooks leave with the block."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, FEATURES), torch.nn.ReLU(), torch.nn.Linear(FEATURES, 8))
    batches = _batches()
    with torch.no_grad(), InputCapture(model, ("0", "2"), {"0": 4}) as capture:
        for x in batches:
            capture.run(model, x)
    assert torch.equal(capture.stats["0"].hessian, _accumulate(batches, skip_prefix=4).hessian)
    with torch.no_grad():
        hidden = [model[1](model[0](x)) for x in batches]
    assert torch.equal(capture.stats["2"].hessian, _accumulate(hidden).hessian)
    reached = []
    model[2].register_forward_pre_hook(lambda _module, args: reached.append(args))
    with torch.no_grad(), InputCapture(model, ("0",), stop_after_last=True) as first_only:
        first_only.run(model, batches[0])
    assert first_only.stats["0"].tokens == batches[0].shape[0] * batches[0].shape[1] and reached == []
    model(batches[0])
    assert len(reached) == 1 and first_only.stats["0"].tokens == batches[0].shape[0] * batches[0].shape[1]


def test_rejects_unbatched_inputs():
    with pytest.raises(ValueError, match=r"expected inputs \[batch, seq, features\], got shape \(10, 96\)"):
        InputStats(FEATURES).add(torch.randn(10, FEATURES))


def test_bf16_product_is_the_hardware_product_up_to_summation_order():
    """Without bf16 hardware the product is taken in float32 from the bf16 operands: each entry is
    within one bfloat16 rounding of PyTorch's own bf16 matmul, whichever path this CPU takes."""
    from quantkit.stats import bf16_product

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g).bfloat16(), torch.randn(96, 80, generator=g).bfloat16()
    exact = a.double() @ b.double()
    got = bf16_product(a, b)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()  # one bf16 rounding of the sum
    emulated = (a.float() @ b.float()).bfloat16()
    assert ((got.double() - emulated.double()).abs() <= emulated.double().abs() * 2**-7).all()


def test_auto_compute_dtype_follows_the_hardware():
    from quantkit.stats import BF16_IN_HARDWARE

    assert compute_dtype("auto") == (torch.bfloat16 if BF16_IN_HARDWARE else torch.float32)
    assert compute_dtype("float32") == torch.float32 and compute_dtype("bfloat16") == torch.bfloat16


def test_bf16_multiplies_takes_float32_products_to_bf16_hardware_and_restores_the_setting():
    """Inside, a float32 product of bf16-valued inputs keeps float32's accuracy on every CPU, at oneDNN's
    bf16 setting where the CPU has bf16 hardware. What that setting does to other inputs depends on the
    CPU: Intel's (AMX, and AVX-512 BF16 alone) multiply the operands' bf16 roundings; an AMD EPYC with
    AVX-512 BF16 kept float32's accuracy there too, in another order of sums. Without bf16 hardware,
    nothing changes."""
    from quantkit.stats import BF16_IN_HARDWARE, bf16_multiplies

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 192, generator=g)  # not bf16 values
    kept = torch.backends.mkldnn.matmul.fp32_precision
    with bf16_multiplies():
        inside = a @ b
        of_bf16_values = a.bfloat16().float() @ b.bfloat16().float()
    assert torch.backends.mkldnn.matmul.fp32_precision == kept
    of_roundings = a.bfloat16().double() @ b.bfloat16().double()
    assert _relative(of_bf16_values, of_roundings) < 1e-6
    if BF16_IN_HARDWARE:
        exact = a.double() @ b.double()
        assert not torch.equal(inside, a @ b)  # the setting was in force
        assert min(_relative(inside, of_roundings), _relative(inside, exact)) < 1e-6
    else:
        assert torch.equal(inside, a @ b)
    plain = a @ b
    with bf16_multiplies(inputs_are_bf16=False):
        assert torch.equal(a @ b, plain) and torch.backends.mkldnn.matmul.fp32_precision == kept


@pytest.mark.parametrize("tiles", [True, False], ids=["AMX where present", "AVX-512 BF16"])
@pytest.mark.parametrize("tokens, features", [(333, 64), (64, 288), (1, 32), (130, 576)])
def test_bf16_gram_kernel_is_the_float64_product_up_to_float32_sums(tokens, features, tiles):
    """quantkit/cpu_ops/gram_ops.cpp, InputStats' Hessian update on bf16 CPUs: odd token counts (a half-filled
    last pair and zero padding), a last panel 32 wide, several 256-wide panels; symmetric to the bit, and
    the same bits on 1 and 2 threads. Without AVX-512 BF16 it declines and changes nothing (PyTorch's
    product runs)."""
    from quantkit import cpu_ops
    from quantkit.stats import BF16_IN_HARDWARE

    ops = cpu_ops.load()
    assert ops is not None
    g = torch.Generator().manual_seed(features)
    rows = (torch.randn(tokens, features, generator=g) * 3).bfloat16()
    mixing = torch.randn(features, features, generator=g)
    start = (mixing @ mixing.T).float()
    hessian = start.clone()
    done = ops.bf16_gram_accumulate(hessian, rows, 0.25, 1.5, tiles)
    assert done == BF16_IN_HARDWARE
    if not done:
        assert torch.equal(hessian, start)
        return
    expected = 0.25 * start.double() + 1.5 * rows.double().T @ rows.double()
    assert (hessian.double() - expected).abs().max() <= 1e-6 * expected.abs().max()
    assert torch.equal(hessian, hessian.T)
    kept, again = torch.get_num_threads(), start.clone()
    try:
        torch.set_num_threads(1)
        ops.bf16_gram_accumulate(again, rows, 0.25, 1.5, tiles)
    finally:
        torch.set_num_threads(kept)
    assert torch.equal(again, hessian)


def test_bf16_gram_kernel_leaves_other_widths_to_pytorch():
    from quantkit import cpu_ops

    hessian = torch.zeros(40, 40)
    assert not cpu_ops.load().bf16_gram_accumulate(hessian, torch.ones(3, 40).bfloat16(), 1.0, 1.0, True)
    assert not hessian.any()
