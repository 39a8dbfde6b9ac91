"""The integer-weight GEMM: kernels/wna16_linear.py (Triton, dequantizing in registers) against
kernels.reference.wna16_linear, on odd shapes, both bit widths, every group size, g_idx in order and shuffled,
symmetric and asymmetric zeros; and the packing both read, against words worked out by hand from GPTQ's layout."""

import pytest
import torch

from kernels import reference
from kernels.launch import cdiv
from kernels.split_k import split_tiles
from kernels.wna16_linear import BFLOAT16_BIAS, FLOAT16_BIAS, WNA16Config, plan
from kernels.wna16_reference import pack_cols, pack_rows, unpack_cols, unpack_rows, wna16_dequantize
from tests.kernels.conftest import load_triton_op


def _case(tokens: int, in_dim: int, out_dim: int, *, bits: int, group: int, shuffled: bool, sym: bool,
          device: str, dtype=torch.float32):
    gen = torch.Generator().manual_seed(tokens * 1000 + in_dim + out_dim + bits)
    group = in_dim if group == -1 else group
    groups, maxq = in_dim // group, (1 << bits) - 1
    q = torch.randint(0, maxq + 1, (in_dim, out_dim), generator=gen, dtype=torch.int32)
    zeros = torch.full((groups, out_dim), (maxq + 1) // 2, dtype=torch.int32) if sym else \
        torch.randint(0, maxq + 1, (groups, out_dim), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, out_dim, generator=gen) * 0.02 + 0.001).half()
    g_idx = (torch.arange(in_dim) // group).to(torch.int32)
    if shuffled:  # act order: the channels dealt into groups in a random order
        g_idx = g_idx[torch.randperm(in_dim, generator=gen)].contiguous()
    x = torch.randn(tokens, in_dim, generator=gen).to(dtype)
    args = (x, pack_rows(q, bits), scales, pack_cols(zeros, bits), g_idx)
    expected = x.double() @ ((q - zeros[g_idx.long()]).double() * scales.double()[g_idx.long()])
    return [a.to(device) for a in args], expected


CASES = [  # (tokens, in, out, bits, group, shuffled g_idx, symmetric)
    pytest.param(1, 96, 40, 4, 32, False, True, id="decode-1-g32-sym"),
    pytest.param(5, 192, 72, 4, 64, True, False, id="g64-act-order-asym"),
    pytest.param(17, 256, 24, 4, 128, True, True, id="g128-act-order-sym"),
    pytest.param(3, 72, 56, 4, -1, False, False, id="per-channel-asym-odd"),
    pytest.param(33, 128, 36, 8, 32, True, False, id="w8-g32-act-order"),
    pytest.param(2, 200, 44, 8, -1, False, True, id="w8-per-channel-odd-k"),
]


@pytest.mark.parametrize(("tokens", "in_dim", "out_dim", "bits", "group", "shuffled", "sym"), CASES)
def test_reference_is_the_product_with_the_dequantized_weight(tokens, in_dim, out_dim, bits, group, shuffled, sym):
    (x, *weights), expected = _case(tokens, in_dim, out_dim, bits=bits, group=group, shuffled=shuffled, sym=sym,
                                    device="cpu")
    got = reference.wna16_linear(x, *weights, bits)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("tokens", "in_dim", "out_dim", "bits", "group", "shuffled", "sym"), CASES)
def test_triton_launcher_matches_the_reference(tokens, in_dim, out_dim, bits, group, shuffled, sym, device):
    """Both paths of the kernel: g_idx read per channel (group_size=0), and groups in order (one row of scales
    and zeros per tile) where the case's g_idx is in order."""
    (x, *weights), _ = _case(tokens, in_dim, out_dim, bits=bits, group=group, shuffled=shuffled, sym=sym,
                             device=device)
    expected = reference.wna16_linear(x.cpu(), *[w.cpu() for w in weights], bits)
    for group_size in [0] if shuffled else [0, in_dim if group == -1 else group]:
        got = load_triton_op("wna16_linear")(x, *weights, bits, group_size=group_size)
        torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("ordered", [False, True], ids=["act-order", "in-order"])
@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
def test_triton_launcher_in_bfloat16(tokens, ordered, device):
    (x, *weights), _ = _case(tokens, 512, 384, bits=4, group=128, shuffled=not ordered, sym=False, device=device,
                             dtype=torch.bfloat16)
    got = load_triton_op("wna16_linear")(x, *weights, 4, group_size=128 if ordered else 0).float()
    expected = reference.wna16_linear(x.float(), *weights, 4)
    assert ((got - expected).abs() <= 2e-2 * expected.abs().amax(1, keepdim=True)).all()


def test_an_empty_batch_returns_no_rows(device):
    (x, *weights), _ = _case(1, 64, 16, bits=4, group=32, shuffled=False, sym=True, device=device)
    assert load_triton_op("wna16_linear")(x[:0], *weights, 4).shape == (0, 16)


def test_launcher_refuses_unpackable_shapes_and_bits():
    (x, qweight, scales, zeros, g_idx), _ = _case(2, 64, 16, bits=4, group=32, shuffled=False, sym=True, device="cpu")
    launcher = load_triton_op("wna16_linear")
    with pytest.raises(ValueError, match="bits must be one of"):
        launcher(x, qweight, scales, zeros, g_idx, 3)
    with pytest.raises(ValueError, match="qweight: expected shape"):
        launcher(x[:, :56], qweight, scales, zeros, g_idx[:56], 4)
    with pytest.raises(ValueError, match="zeros: expected shape"):
        launcher(x, qweight, scales, zeros[:, :1], g_idx, 4)


def test_packing_puts_the_first_value_in_the_lowest_bits():
    """GPTQ's layout (GPTQModel's pack: qweight[row] |= intweight[j] << (bits * (j - i))): 0..7 down a column
    of eight 4-bit rows is the word 0x76543210; 8-bit rows 1, 2, 3, 4 are 0x04030201."""
    column = torch.arange(8, dtype=torch.int32)[:, None]
    assert pack_rows(column, 4).item() == 0x76543210
    assert pack_rows(torch.tensor([[1], [2], [3], [15]], dtype=torch.int32), 8).item() == 0x0F030201
    assert pack_rows(torch.full((8, 1), 15, dtype=torch.int32), 4).item() == -1  # 0xFFFFFFFF as int32
    assert pack_cols(column.t(), 4).item() == 0x76543210
    values = torch.randint(0, 16, (24, 16), dtype=torch.int32)
    assert torch.equal(unpack_rows(pack_rows(values, 4), 4), values)
    assert torch.equal(unpack_cols(pack_cols(values, 4), 4), values)


def test_dequantize_uses_each_channels_own_group():
    q = torch.tensor([[3], [5]], dtype=torch.int32)  # two input channels, one output
    zeros, scales = torch.tensor([[1], [2]], dtype=torch.int32), torch.tensor([[0.5], [2.0]])
    g_idx = torch.tensor([1, 0], dtype=torch.int32)  # channel 0 in group 1, channel 1 in group 0
    w = wna16_dequantize(pack_rows(torch.cat([q, torch.zeros(6, 1, dtype=torch.int32)]), 4), scales,
                         pack_cols(torch.cat([zeros, torch.zeros(2, 7, dtype=torch.int32)], 1), 4)[:, :1],
                         torch.cat([g_idx, torch.zeros(6, dtype=torch.int32)]), 4)
    assert w[:2, 0].tolist() == [(3 - 2) * 2.0, (5 - 1) * 0.5]


@pytest.mark.parametrize(("counts", "bits", "group", "shuffled"), [
    pytest.param([3, 0, 18, 1], 4, 32, True, id="w4-act-order-empty-expert"),
    pytest.param([0, 5, 0], 8, -1, False, id="w8-per-channel-one-busy-expert"),
    pytest.param([1, 1, 1, 1, 1], 4, 64, False, id="decode-rows"),
])
def test_grouped_launcher_matches_the_reference(counts, bits, group, shuffled, device):
    """Each expert's packed weight over its rows of an expert-sorted batch (experts with no rows included)."""
    in_dim, out_dim = 128, 48
    experts = [_case(1, in_dim, out_dim, bits=bits, group=group, shuffled=shuffled, sym=e % 2 == 0, device="cpu")
               for e in range(len(counts))]
    stacked = [torch.stack([case[0][i] for case in experts]) for i in range(1, 5)]  # qweight, scales, zeros, g_idx
    x = torch.randn(sum(counts), in_dim, generator=torch.Generator().manual_seed(len(counts)))
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    expected = reference.wna16_grouped_matmul(x, *stacked, offsets, bits)
    for e, case in enumerate(experts):  # the reference is each expert's own product
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        torch.testing.assert_close(expected[rows], reference.wna16_linear(x[rows], *case[0][1:], bits))
    for group_size in [0] if shuffled else [0, in_dim if group == -1 else group]:
        got = load_triton_op("wna16_grouped_matmul")(x.to(device), *[t.to(device) for t in stacked],
                                                     offsets.to(device), bits, group_size=group_size)
        torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 64)])
def test_act_order_sorted_at_load_takes_the_in_order_path(bits, group, device):
    """An act-order weight with its input channels sorted by group (as IntLinear does at load) and x's columns
    read through perm gives the product of the original."""
    (x, qweight, scales, zeros, g_idx), _ = _case(7, 192, 40, bits=bits, group=group, shuffled=True, sym=False,
                                                  device="cpu")
    expected = reference.wna16_linear(x, qweight, scales, zeros, g_idx, bits)
    perm = torch.argsort(g_idx, stable=True).to(torch.int32)
    sorted_q = pack_rows(unpack_rows(qweight, bits)[perm.long()], bits)
    in_order = (torch.arange(192) // group).to(torch.int32)
    args = (sorted_q, scales, zeros, in_order, bits)
    torch.testing.assert_close(reference.wna16_linear(x, *args, group_size=group, perm=perm), expected)
    got = load_triton_op("wna16_linear")(x.to(device), *[a.to(device) if torch.is_tensor(a) else a for a in args],
                                         group_size=group, perm=perm.to(device))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    stacked = [torch.stack([t, t]).to(device) for t in (sorted_q, scales, zeros, in_order)]
    offsets = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
    got = load_triton_op("wna16_grouped_matmul")(x.to(device), *stacked, offsets, bits, group_size=group,
                                                 perm=torch.stack([perm, perm]).to(device))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


SPLIT_CASES = {  # (tokens, in, out, bits, group (0: act order), config): splits ending inside a tile count or past it
    "ten-tiles-in-3-splits": (3, 320, 72, 4, 32, WNA16Config(16, 64, 32, split_k=3)),
    "ten-tiles-in-7-splits": (3, 320, 72, 4, 32, WNA16Config(16, 64, 32, split_k=7)),
    "more-splits-than-tiles": (2, 320, 40, 4, 32, WNA16Config(16, 64, 32, split_k=16)),
    "three-row-blocks-w8": (37, 256, 40, 8, 64, WNA16Config(16, 64, 64, split_k=2)),
    "rows-of-32-per-channel": (33, 384, 48, 4, -1, WNA16Config(32, 64, 128, split_k=2, num_stages=2)),
    "act-order": (5, 192, 56, 4, 0, WNA16Config(16, 64, 64, split_k=2)),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES.values()), ids=list(SPLIT_CASES))
def test_split_k_and_given_configurations_match_the_reference(case, device):
    tokens, in_dim, out_dim, bits, group, config = case
    (x, *weights), _ = _case(tokens, in_dim, out_dim, bits=bits, group=32 if group == 0 else group,
                             shuffled=group == 0, sym=False, device=device)
    expected = reference.wna16_linear(x.cpu(), *[w.cpu() for w in weights], bits)
    group_size = 0 if group == 0 else in_dim if group == -1 else group
    got = load_triton_op("wna16_linear")(x, *weights, bits, group_size=group_size, config=config)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_a_configuration_straddling_groups_is_refused():
    (x, *weights), _ = _case(2, 128, 16, bits=4, group=32, shuffled=False, sym=True, device="cpu")
    with pytest.raises(ValueError, match="straddles the groups of 32"):
        load_triton_op("wna16_linear")(x, *weights, 4, group_size=32, config=WNA16Config(16, 64, 64))


@pytest.mark.parametrize("bits", [4, 8])
def test_triton_launcher_in_float16(bits, device):
    """float16 takes the no-conversion path (1024 + q in the mantissa), in the interpreter too (bfloat16 cannot:
    the interpreter's bfloat16 arithmetic is wrong; test_triton_launcher_in_bfloat16 runs it on a GPU)."""
    (x, *weights), _ = _case(7, 256, 48, bits=bits, group=64, shuffled=False, sym=False, device=device,
                             dtype=torch.float16)
    got = load_triton_op("wna16_linear")(x, *weights, bits, group_size=64).float()
    expected = reference.wna16_linear(x.float(), *weights, bits)
    assert ((got - expected).abs() <= 1e-2 * expected.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize(("bias", "dtype", "bits"), [(FLOAT16_BIAS, torch.float16, 8), (BFLOAT16_BIAS, torch.bfloat16, 4)],
                         ids=["float16", "bfloat16"])
def test_the_biases_or_a_value_into_a_float_exactly(bias, dtype, bits):
    """minus_zero's premise: bias | q, read as the float type, is bias's float + q for every value q of `bits`."""
    q = torch.arange(1 << bits, dtype=torch.int32)
    base = torch.tensor([bias.value], dtype=torch.int32).to(torch.int16).view(dtype).float()
    assert torch.equal((q | bias.value).to(torch.int16).view(dtype).float(), base + q.float())


PROJECTIONS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


@pytest.mark.parametrize("projection", list(PROJECTIONS))
def test_at_decode_shapes_the_plan_streams_from_every_sm(projection):
    """Llama-3-8B at 1, 16 and 64 tokens on 132 SMs: one program per 64 columns would be 64 programs for o and down
    at one token (half the SMs idle), each running 64 or 224 steps. The plan: at least 2 programs per SM up to 16 tokens, all but
    a few SMs busy at 64, at most 32 steps a program, and float32 partials under a quarter of the weight's bytes."""
    in_dim, out_dim = PROJECTIONS[projection]
    for tokens in (1, 16, 64):
        config = plan(tokens, out_dim, in_dim, 128, 4, 132)
        tiles, splits = split_tiles(cdiv(in_dim, config.block_k), config.split_k)
        programs = cdiv(tokens, config.block_m) * cdiv(out_dim, config.block_n) * splits
        assert programs >= (2 * 132 if tokens <= 16 else 128), (tokens, config, programs)
        assert tiles <= 32, (tokens, config)
        assert splits * tokens * out_dim * 4 <= in_dim * out_dim // 2 / 4 or splits == 1, (tokens, config)


def test_the_launch_depends_on_the_static_shape_only(monkeypatch):
    """The CUDA-graph contract: two calls of the same shapes with other values launch alike (split-K included)."""
    import importlib

    module = importlib.import_module("kernels.wna16_linear")
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(
                (grid, tuple(a for a in args if not isinstance(a, torch.Tensor)), kwargs))

    monkeypatch.setattr(module, "_wna16_kernel", Recorder())
    monkeypatch.setattr(importlib.import_module("kernels.split_k"), "_sum_kernel", Recorder())
    monkeypatch.setattr(module, "multiprocessor_count", lambda device: 132)  # an H200's: split-K
    for seed in (1, 2):
        (x, *weights), _ = _case(1, 4096, 1024, bits=4, group=128, shuffled=False, sym=seed == 1, device="cpu")
        module.wna16_linear(x * seed, *weights, 4, group_size=128)
    assert len(launches) == 4 and launches[:2] == launches[2:]
