"""The runtime's quantized linears (quantkit.kernels.linear) on artifacts of every format: the
reference path is the dequantized weight bit for bit, the fast CPU path is within bf16 tolerance of
it (decode and prefill rows, act-order, ragged groups), and the runtime runs the artifact."""
from __future__ import annotations

import os

import pytest
import torch

from quantkit import cpu_ops
from quantkit.engine import quantize
from quantkit.kernels.linear import int4, int8, load_linears, panel
from quantkit.kernels.linear.int4 import Int4Linear
from quantkit.kernels.linear.int8 import Int8Linear
from quantkit.kernels.linear.packed import DECODE_ROWS
from quantkit.kernels.linear.panel import PANEL, pack_group_size
from quantkit.kernels.linear.ternary import TernaryLinear
from quantkit.kernels.model import fuse_linears
from quantkit.loading import load_model
from quantkit.recipe import load_recipe

FAST = {"calibration.n_samples": 4, "calibration.seq_len": 64}
# (recipe, format override, extra settings, checkpoint variant)
ARTIFACTS = {
    "gptq-act-order": ("gptq-w4g128", {"gptq.desc_act": True, "gptq.group_aware": False},
                       dict(hidden_size=320, num_attention_heads=10)),  # K = 320: a ragged last group
    "awq": ("awq-w4g128", {}, dict()),
    "marlin": ("rtn-w4g128", {"format": "marlin", "quant.sym": True}, dict(num_key_value_heads=4)),
    "cpmcu": ("rtn-w4g128", {"format": "cpmcu", "quant.sym": True}, dict(num_key_value_heads=4)),
    "gguf-q4_0": ("gguf-q4_0", {}, dict()),
    "rtn-3bit": ("rtn-w4g128", {"quant.bits": 3}, dict(num_key_value_heads=2)),  # 3-bit packs N in 32s
    "ternary": ("rtn-ternary-g32", {}, dict()),
}
FAST_MODULE = {"ternary": TernaryLinear}  # others with a 4-bit uniform grid: Int4Linear


@pytest.fixture(scope="module", params=sorted(ARTIFACTS))
def artifact(request, tiny_checkpoint_factory, tmp_path_factory):
    recipe, settings, variant = ARTIFACTS[request.param]
    out = tmp_path_factory.mktemp(request.param) / "artifact"
    quantize(tiny_checkpoint_factory(**variant), load_recipe(recipe, {**FAST, **settings}), out, progress=False)
    return request.param, out


def test_reference_is_the_dequantized_weight_and_cpu_is_within_bf16(artifact):
    name, path = artifact
    model = load_model(path)
    reference, fast = load_linears(path, "reference"), load_linears(path, "cpu")
    expected = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    assert set(reference) == set(fast) == expected
    for key, module in reference.items():
        assert torch.equal(module.weight, model.get_submodule(key).weight), key
        for rows in (1, 64):  # decode (packed int4 kernel) and prefill (bf16 dequantized matmul)
            x = torch.randn(rows, module.in_features)
            want = module(x)
            got = fast[key](x.bfloat16()).float()
            # bf16 inputs, scales and outputs: relative error a few 2^-8 of the output scale
            assert ((got - want).abs().max() / want.abs().max()) < 3e-2, (name, key, rows)
    if name != "rtn-3bit" and not name.startswith("gguf"):
        assert all(isinstance(m, FAST_MODULE.get(name, Int4Linear)) for m in fast.values())


def test_runtime_runs_the_artifact_close_to_the_reference(artifact):
    from quantkit.kernels.generate import TextGeneratorLM, load_text_generator

    _, path = artifact
    tokens = torch.randint(0, 300, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = torch.log_softmax(load_model(path)(tokens).logits[0].double(), -1)
    got = torch.log_softmax(TextGeneratorLM(load_text_generator(path, prefill_chunk=40))(tokens).logits[0].double(), -1)
    kl = (want.exp() * (want - got)).sum(-1).mean()
    # bf16 activations, int8 LM head: KL ~1e-3 on random tiny models; a wrong layout gives > 1
    assert kl < 2e-2


def test_every_stored_layout_a_format_declares_has_its_kernel():
    """A format's ``stored_layout`` and the runtime's kernels for it are named alike, so no artifact that
    could run on its stored tensors silently falls back to the records."""
    from quantkit.formats import FORMATS
    from quantkit.kernels.linear import LAYOUT_KERNELS

    assert {layout for _, layout in LAYOUT_KERNELS} == {fmt.stored_layout for fmt in FORMATS.values()} - {None}


def test_pack_group_avoids_padding():
    assert pack_group_size(128, 576) == 64 and pack_group_size(-1, 4096) == 256 and pack_group_size(32, 576) == 32
    assert pack_group_size(128, 100) == 128  # no size divides 100: padded


@pytest.mark.parametrize("recipe,kind", [("rtn-w4g128", Int4Linear), ("rtn-ternary-g32", TernaryLinear)])
def test_fused_quantized_linears_equal_the_separate_ones(recipe, kind, tiny_checkpoint_factory, tmp_path):
    out = tmp_path / "rtn"
    quantize(tiny_checkpoint_factory(), load_recipe(recipe, FAST), out, progress=False)
    linears = load_linears(out, "cpu")
    parts = [linears[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"]
    fused = fuse_linears(parts)
    assert isinstance(fused, kind)
    for rows in (1, 20):
        x = torch.randn(rows, parts[0].in_features).bfloat16()
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


@pytest.mark.parametrize("k", [576, 200], ids=["groups-of-64", "padded-columns"])
def test_int8_lm_head_error_is_half_a_step_per_group(k):
    """Each group's bf16 scale is rounded up, so every weight is within half a step of its code; the
    decode kernel's rows and the dense path's agree with the dequantized weight to bf16 rounding."""
    n = 300
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(6))
    head = Int8Linear(weight)
    assert head.group_size == (64 if k == 576 else 128) and head.padded_in == (576 if k == 576 else 256)
    dequantized = head.dequantized(torch.float32)[:, :k]
    step = head.scale_offset_bf16[:, :n, 0].float().T.repeat_interleave(head.group_size, 1)[:, :k]
    assert ((dequantized - weight).abs() <= step / 2).all()
    assert (head.scale_offset_bf16[..., 1] == 0).all()
    for rows in (1, 3, 9):  # the integer kernel (int8 activations) up to DECODE_ROWS, then where prefill runs it
        x = torch.randn(rows, k).bfloat16()
        exact = x.double() @ dequantized.double().T
        grouped = torch.nn.functional.pad(x.double(), (0, head.padded_in - k)).view(rows, -1, head.group_size)
        integer = rows <= DECODE_ROWS or panel.prefill_kernel() == "int8"
        half_steps = grouped.abs().amax(-1) / 127 / 2 * integer
        weight_sums = torch.nn.functional.pad(dequantized.double().abs(), (0, head.padded_in - k))
        # plus the bf16 roundings (of the dense path's weight, of the output): each under 2^-8 of sum |x w|
        rounding = 2 ** -7 * (x.double().abs() @ dequantized.double().abs().T)
        bound = half_steps @ weight_sums.view(n, -1, head.group_size).sum(-1).T + rounding
        assert ((head(x).double() - exact).abs() <= bound).all()


def test_int8_layout_puts_each_code_where_the_kernel_reads_it():
    """Byte 4 r + c of the first 256 bytes of each 512-byte run (a panel of 64 rows, 8 columns) holds row
    r's code of column c, of the next 256 its code of column c + 4; rows are padded with code 128."""
    from quantkit.kernels.linear.int8 import codes_of_int8_layout, int8_layout

    n, k = 80, 24
    codes = torch.randint(0, 256, (n, k), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    packed = int8_layout(codes)
    assert packed.numel() == 128 * k
    padded = torch.nn.functional.pad(codes, (0, 0, 0, 128 - n), value=128)
    for index, run, half, row, c in ((0, 0, 0, 0, 0), (0, 2, 1, 63, 3), (1, 1, 0, 5, 2), (1, 2, 1, 40, 1)):
        byte = int(packed[(index * k // 8 + run) * 512 + half * 256 + 4 * row + c])
        assert byte == int(padded[64 * index + row, 8 * run + 4 * half + c])
    assert torch.equal(codes_of_int8_layout(packed, 128, k), padded)


def test_prepacked_bf16_linear_equals_f_linear_up_to_16_rows():
    """oneDNN's reordered weight changes where a matmul's time goes, not its result; a CPU without
    oneDNN's bf16 path (AVX2 only) keeps the plain linear."""
    import torch.nn.functional as F

    from quantkit.kernels.linear.prepacked import PrepackedLinear, prepackable, prepacked

    linear = torch.nn.Linear(576, 960).bfloat16()
    fast = prepacked(linear)
    if not prepackable(linear.weight):
        assert fast is linear
        return
    float32 = torch.nn.Linear(576, 960)
    assert isinstance(fast, PrepackedLinear) and prepacked(float32) is float32  # only bf16 is reordered
    with torch.inference_mode():
        for rows in range(1, 17):
            x = torch.randn(rows, 576).bfloat16()
            assert torch.equal(fast(x), F.linear(x, linear.weight, linear.bias)), rows
        assert torch.equal(fast(x[0]), F.linear(x[0], linear.weight, linear.bias))  # one token as a vector


def test_a_few_rows_never_dequantize_a_weight_that_is_not_kept():
    """Without a kept dequantized weight (a large model), a draft tree's rows run the packed kernel, as
    close to the reference as the dense path is."""
    from quantkit.kernels.linear.packed import FEW_ROWS
    from quantkit.quant import QuantConfig, rtn_quantize

    weight = torch.randn(256, 576, generator=torch.Generator().manual_seed(0)) * 0.02
    record = rtn_quantize(weight, QuantConfig(4, 128, sym=True))
    kept, streamed = Int4Linear.from_record(record), Int4Linear.from_record(record, keep_dequantized=False)
    streamed._dequantize = lambda dtype, **_: pytest.fail("dequantized the whole weight for a few rows")
    x = torch.randn(FEW_ROWS, 576).bfloat16()
    want = x.float() @ record.dequantize(torch.float32).T
    for module in (kept, streamed):
        assert ((module(x).float() - want).abs().max() / want.abs().max()) < 3e-2


def test_a_cpu_without_onednn_bf16_keeps_nn_linear():
    """A desktop CPU with AVX2 only (oneDNN held to it here) cannot reorder a bf16 weight: the linear stays
    ``nn.Linear`` and still runs, rather than failing at load."""
    import os
    import subprocess
    import sys

    probe = ("import torch; from quantkit.kernels.linear.prepacked import prepacked; "
             "linear = torch.nn.Linear(64, 32).bfloat16(); fast = prepacked(linear); "
             "print(fast is linear, tuple(fast(torch.randn(3, 64).bfloat16()).shape))")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "(3,", "32)"]



def _dequantize_as_before(module: Int4Linear, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The formula ``Int4Linear._dequantize`` had before it worked in chunks on the packed codes."""
    pairs = module.scale_offset_bf16[:, :module.out_features].float().repeat_interleave(module.group_size, dim=0)
    return ((codes.float() - 8) * pairs[..., 0].T + pairs[..., 1].T).to(dtype)


@pytest.mark.parametrize("n,k,group_size", [(144, 576, 128), (112, 336, 128), (208, 320, 32), (64, 4096, 128)])
def test_dequantize_is_the_previous_formula_bit_for_bit(n, k, group_size, monkeypatch):
    """A last, partial panel of the layout (144 = 2 x 64 + 16), K = 576 packed as groups of 64 sharing
    their group-128 scale, K = 336 padded to 384, several chunks of rows."""
    from quantkit.quant import QuantConfig, rtn_quantize

    monkeypatch.setattr(int4, "DEQUANTIZE_CHUNK", 64 * 64)  # forces chunks of one or a few panels
    generator = torch.Generator().manual_seed(n + k)
    record = rtn_quantize(torch.randn(n, k, generator=generator) * 0.02, QuantConfig(4, group_size, sym=False))
    module = Int4Linear.from_record(record)
    codes = torch.nn.functional.pad(record.codes, (0, module.padded_in - k), value=8)
    assert torch.equal(module._codes(), codes.to(torch.uint8))
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        got = module._dequantize(dtype)
        assert torch.equal(got.view(bits), _dequantize_as_before(module, codes, dtype).view(bits))
    assert cpu_ops.load() is not None  # so the bf16 weight above came from int4_dequantize_t
    monkeypatch.setattr(cpu_ops, "load", lambda: None)  # and now PyTorch's chunks
    assert torch.equal(module._dequantize(torch.bfloat16).view(torch.int16),
                       _dequantize_as_before(module, codes, torch.bfloat16).view(torch.int16))


def test_int4_layout_puts_each_code_where_the_kernels_read_it():
    """Byte 4 r + c of each 256-byte run (a panel of 64 rows, 8 columns) holds row r's codes of columns c
    (low nibble) and c + 4 (high); rows are padded with code 8 to whole panels; the inverse is exact."""
    n, k = 80, 24  # two panels, the second with 16 rows; 3 runs of 8 columns
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    packed = int4.int4_layout(codes)
    assert packed.numel() == 128 * k // 2
    padded = torch.nn.functional.pad(codes, (0, 0, 0, 128 - n), value=8)
    for index, run, row, c in ((0, 0, 0, 0), (0, 2, 63, 3), (1, 1, 5, 2), (1, 2, 40, 1)):
        byte = int(packed[(index * k // 8 + run) * 256 + 4 * row + c])
        code_row = padded[64 * index + row]
        assert (byte & 15, byte >> 4) == (int(code_row[8 * run + c]), int(code_row[8 * run + c + 4]))
    assert torch.equal(int4.codes_of_layout(packed, 128, k), padded)


# Bits -> (the kernel, the codes' layout): int4_int8_matmul and int8_int8_matmul share one implementation
CODE_KERNELS = {4: ("int4_int8_matmul", int4.int4_layout), 8: ("int8_int8_matmul", int8.int8_layout)}


def _random_codes(n: int, k: int, bits: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 1 << bits, (n, k), generator=generator, dtype=torch.uint8)


def _layout(codes: torch.Tensor, pairs: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' codes and scale/offset pairs (rows padded to whole panels) of codes [N, K] and pairs [G, N, 2]."""
    padding = -codes.shape[0] % PANEL
    return CODE_KERNELS[bits][1](codes), torch.nn.functional.pad(pairs, (0, 0, 0, padding))


def _int8_prefill_reference(x: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor, group: int,
                            bits: int = 4) -> torch.Tensor:
    """The kernels' result in float64: x quantized to int8 per row and group (alpha = max|x| / 127, x *
    (127 / max|x|) rounded to even, each quotient rounded once to float32) times W = (q - mid) s + z,
    mid = 8 for 4-bit codes and 128 for 8-bit ones."""
    m, k = x.shape
    xg = x.float().view(m, -1, group)
    top = xg.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.full_like(top, 127.0).div(top), torch.zeros_like(top))
    quantized = ((xg * inverse).round().double() * top.div(127.0).double()).view(m, k)
    scales, offsets = (pairs[..., i].double().repeat_interleave(group, 0).T for i in (0, 1))
    return quantized @ ((codes.double() - (1 << bits - 1)) * scales + offsets).T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128])
def test_int8_product_is_its_formula(group, bits):
    """Against the formula in float64: float32 results to float32 rounding, bf16 ones to bf16 rounding;
    208 output rows (a last panel of 16), tiles of rows and a remainder, a row group of zeros."""
    n, k = 208, 512
    generator = torch.Generator().manual_seed(group)
    codes = _random_codes(n, k, bits, generator)
    pairs = (torch.randn(k // group, n, 2, generator=generator) * 0.01).bfloat16()
    packed, padded_pairs = _layout(codes, pairs, bits)
    kernel = getattr(cpu_ops.load(), CODE_KERNELS[bits][0])
    for m in (1, 7, 13):
        x = torch.randn(m, k, generator=generator).bfloat16()
        x[0, :group] = 0
        expected = _int8_prefill_reference(x, codes, pairs, group, bits)
        got = kernel(x.float(), packed, padded_pairs, n, k, group)
        assert got.dtype == torch.float32
        assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max()
        got = kernel(x, packed, padded_pairs, n, k, group)
        assert got.dtype == torch.bfloat16
        assert ((got.double() - expected).abs() <= 2 ** -8 * expected.abs() + 1e-6 * expected.abs().max()).all()


def test_int8_product_error_is_within_half_an_activation_step():
    """Against the exact product x W^T: each int8 activation is off by at most alpha / 2, so each output
    by at most sum over groups of alpha / 2 * sum |w| (plus float32 rounding); and for Gaussian rows
    the error's RMS is under 1 % of the output's."""
    n, k, group = 256, 1024, 128
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    pairs = (torch.randn(k // group, n, 2, generator=generator) * 0.01).bfloat16()
    x = torch.randn(9, k, generator=generator)
    got = cpu_ops.load().int4_int8_matmul(x, *_layout(codes, pairs), n, k, group).double()
    scales, offsets = (pairs[..., i].double().repeat_interleave(group, 0).T for i in (0, 1))
    weight = (codes.double() - 8) * scales + offsets
    exact = x.double() @ weight.T
    half_step = x.double().view(9, -1, group).abs().amax(-1) / 127 / 2                     # [m, groups]
    bound = half_step @ weight.abs().view(n, -1, group).sum(-1).T + 1e-6 * exact.abs().max()
    assert ((got - exact).abs() <= bound).all()
    assert (got - exact).pow(2).mean().sqrt() < 0.01 * exact.pow(2).mean().sqrt()


def test_prefill_kernel_follows_amx_and_the_override(monkeypatch):
    """Held below AMX, oneDNN's bf16 is slow and prefill goes to integer dot products; the override wins
    both ways and is checked; an Int4Linear's prefill rows and the int8 LM head's rows beyond the decode
    rows then run the kernel and keep no bf16 copy."""
    def choice(**env):
        for name in ("ONEDNN_MAX_CPU_ISA", panel.PREFILL_OVERRIDE):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        panel.prefill_kernel.cache_clear()
        return panel.prefill_kernel()

    try:
        assert cpu_ops.load().int4_int8_isa() != "scalar"  # an x86-64 build has AVX2 at least
        assert choice(ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16") == "int8"
        assert choice() == ("bf16" if torch.cpu._is_amx_tile_supported() else "int8")
        assert choice(QUANTKIT_CPU_PREFILL="bf16", ONEDNN_MAX_CPU_ISA="AVX2") == "bf16"
        assert choice(QUANTKIT_CPU_PREFILL="int8") == "int8"
        generator = torch.Generator().manual_seed(2)
        scales, offsets = (torch.rand(2, 192, generator=generator) * 0.01 for _ in range(2))
        module = Int4Linear(torch.randint(0, 16, (192, 256), generator=generator, dtype=torch.uint8), scales, offsets,
                            128, 256)
        x = torch.randn(20, 256, generator=generator).bfloat16()
        expected = cpu_ops.load().int4_int8_matmul(x, module.packed, module.scale_offset_bf16, 192, 256, 128)
        assert torch.equal(module(x), expected) and module._kept is None
        head = Int8Linear(torch.randn(192, 256, generator=generator))  # a draft tree's 13 rows through the LM head
        rows = x[:13].contiguous()
        expected = cpu_ops.load().int8_int8_matmul(rows, head.packed, head.scale_offset_bf16, 192, 256, 128)
        assert torch.equal(head(rows), expected) and head._kept is None
        with pytest.raises(ValueError, match="QUANTKIT_CPU_PREFILL"):
            choice(QUANTKIT_CPU_PREFILL="vnni")
    finally:
        panel.prefill_kernel.cache_clear()


@pytest.mark.parametrize("march,isa,k,group", [("haswell", "avx2", 512, 128), ("haswell", "avx2", 480, 24),
                                               ("haswell", "avx2", 440, 40), ("x86-64", "scalar", 440, 40)],
                         ids=["avx2-16-steps", "avx2-3-steps", "avx2-5-steps", "scalar"])
def test_int8_product_built_for_another_cpu_computes_the_same(tmp_path, march, isa, k, group):
    """The AVX2 path (no AVX-512, no VNNI: many desktops) built with QUANTKIT_CPU_MARCH=haswell and run in
    a process of its own gives the reference's results to float32 rounding: 11 rows (a tile of 8 and one
    of 3, whose 8-column steps add in int16 two at a time), 5 rows alone (a verification: one row at a
    time) and one row alone (the whole panel, two steps at a time), on groups whose steps divide evenly and
    groups that leave steps over (3 and 5 steps a group); and 8-bit codes, whose products are taken signed
    (codes - 128), on the same rows and groups. So does the plain loops' path of a CPU without AVX2 (x86-64)."""
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(3)
    n = 208
    x = torch.randn(11, k, generator=generator)
    inputs, expected = {"x": x}, {}
    for bits in CODE_KERNELS:
        codes = _random_codes(n, k, bits, generator)
        pairs = (torch.randn(k // group, n, 2, generator=generator) * 0.01).bfloat16()
        inputs[f"packed{bits}"], inputs[f"pairs{bits}"] = _layout(codes, pairs, bits)
        expected[bits] = _int8_prefill_reference(x, codes, pairs, group, bits)
    save_file(inputs, tmp_path / "inputs.safetensors")
    kernels = {bits: name for bits, (name, _) in CODE_KERNELS.items()}
    script = (f"import torch; from safetensors.torch import load_file, save_file; from quantkit import cpu_ops;"
              f"t = load_file({str(tmp_path / 'inputs.safetensors')!r}); ops = cpu_ops.load(); "
              f"assert ops.int4_int8_isa() == {isa!r}, ops.int4_int8_isa(); "
              f"save_file({{f'y{{bits}}_{{m}}': getattr(ops, kernel)(t['x'][:m].contiguous(), t[f'packed{{bits}}'], "
              f"t[f'pairs{{bits}}'], {n}, {k}, {group}) for bits, kernel in {kernels!r}.items() "
              f"for m in (11, 5, 1)}}, {str(tmp_path / 'y.safetensors')!r})")
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, cpu_ops.MARCH_OVERRIDE: march},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = load_file(tmp_path / "y.safetensors")
    for bits in CODE_KERNELS:
        for m in (11, 5, 1):
            reference = expected[bits][:m]
            assert (got[f"y{bits}_{m}"].double() - reference).abs().max() <= 1e-6 * reference.abs().max()


def test_a_weight_rebuilt_per_call_reuses_one_buffer_and_computes_the_same(monkeypatch):
    """A model that keeps no dequantized weight rebuilds each one into this thread's buffer (for prefill
    by the bf16 weight, what a CPU with AMX runs)."""
    monkeypatch.setattr(panel, "prefill_kernel", lambda: "bf16")
    generator = torch.Generator().manual_seed(1)
    modules = [Int4Linear(torch.randint(0, 16, (n, 256), generator=generator, dtype=torch.uint8),
                          torch.rand(2, n, generator=generator) * 0.01, torch.rand(2, n, generator=generator) * 0.01,
                          128, 256, keep_dequantized=False) for n in (192, 128)]
    x = torch.randn(40, 256, generator=generator).bfloat16()
    buffers = set()
    for module in modules:
        rebuilt = module._rebuilt(torch.bfloat16)
        buffers.add(rebuilt.data_ptr())
        assert torch.equal(rebuilt, module._dequantize(torch.bfloat16))
        assert torch.equal(module(x), x @ module._dequantize(torch.bfloat16).T)
    assert len(buffers) == 1


def test_a_loaded_runtime_holds_each_int4_weight_once(tiny_checkpoint_factory, tmp_path):
    """One copy of the codes per module (the packed kernel's) and, once q/k/v and gate/up are fused, the
    model's unfused linears are views of the fused modules; the model still computes what it did."""
    from quantkit.kernels.attention import make_attention
    from quantkit.kernels.load import load_runtime_model
    from quantkit.kernels.model import FusedPart, RuntimeModel

    out = tmp_path / "rtn"
    quantize(tiny_checkpoint_factory(), load_recipe("rtn-w4g128", FAST), out, progress=False)
    model = load_runtime_model(out, torch.bfloat16)
    layer = model.model.layers[0]
    fused = [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("mlp", "gate_proj"),
             ("mlp", "up_proj")]
    inputs = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        before = [getattr(getattr(layer, parent), name)(inputs) for parent, name in fused]
    def bytes_of_rows(modules):  # codes and scale/offset pairs of the real rows (the layout pads each module's)
        return sum(m.out_features * (m.padded_in // 2 + 4 * m.padded_in // m.group_size) for m in modules)

    quantized_bytes = bytes_of_rows(m for m in model.modules() if isinstance(m, Int4Linear))
    runtime = RuntimeModel(model, make_attention(None))
    parts = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    assert all(isinstance(p, FusedPart) and p.whole is runtime.layers[0].qkv for p in parts)
    assert isinstance(layer.mlp.up_proj, FusedPart) and layer.mlp.up_proj.whole is runtime.layers[0].gate_up
    modules = [m for m in model.modules() if isinstance(m, Int4Linear)]  # each module once
    assert len(modules) == 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down
    for module in modules:
        held = sum(b.numel() * b.element_size() for name, b in module.named_buffers() if name != "bias")
        assert held == module.weight_bytes  # the packed codes and the bf16 scale/offset pairs, nothing else
    assert bytes_of_rows(modules) == quantized_bytes
    with torch.inference_mode():  # the views compute what the unfused linears did
        after = [getattr(getattr(layer, parent), name)(inputs) for parent, name in fused]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    again = RuntimeModel(model, make_attention(None))  # a second runtime on the model reuses the fused modules
    assert again.layers[0].qkv is runtime.layers[0].qkv
