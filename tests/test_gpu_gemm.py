"""The Hopper skinny GEMM (torch.ops.mla_decode.gemm_nt): y = x W^T against
a float64 evaluation of the same bf16 inputs, with fresh random inputs,
outputs written into NaN-filled buffers larger than the result (nothing
outside it may change), split-K tails (k not a multiple of 64), partial
tiles (n not a multiple of the tile), batches through strided views, two
weights in one launch and rows placed by the device (the cache append).
Runs where the Hopper kernels do (an sm_90a build on a compute 9.x GPU)."""

import pytest
import torch

import mla_decode
from mla_decode import projections

from conftest import assert_task_rule


def _hopper():
    if not mla_decode.kernels_usable("cuda"):
        return False
    return mla_decode.kernel_choice.hopper("cuda")


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs the Hopper kernels (an sm_90a build on a compute 9.x "
                                  f"GPU): {mla_decode.backend('cuda')}")
pytestmark = [needs_hopper, pytest.mark.gpu]


def bf(t):
    return t.to(torch.bfloat16)


def rand(*shape, g, scale=1.0):
    return bf(scale * torch.randn(*shape, generator=g, device="cuda"))


def nan_padded(rows, cols, pad=8):
    """A NaN-filled [rows + pad, cols + pad] buffer and its [rows, cols] corner (row stride cols + pad)."""
    buf = torch.full((rows + pad, cols + pad), float("nan"), dtype=torch.bfloat16, device="cuda")
    return buf, buf[:rows, :cols]


def ref(x, w):
    return bf(x.double() @ w.double().transpose(-1, -2))


def check_outside_untouched(buf, view, name):
    mask = torch.ones_like(buf, dtype=torch.bool)
    mask[: view.shape[0], : view.shape[1]] = False
    assert torch.isnan(buf[mask]).all(), f"{name}: the kernel wrote outside its output"


@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (3, 200, 104), (32, 1536, 7168), (64, 576, 1536), (100, 24576, 1536),
                                   (128, 7168, 16384), (129, 512, 640), (200, 1024, 7168), (256, 2048, 512)])
def test_gemm_matches_float64(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    x, w = rand(m, k, g=g), rand(n, k, g=g, scale=k ** -0.5)
    buf, y = nan_padded(m, n)
    torch.ops.mla_decode.gemm_nt(x, w, y)
    assert_task_rule(y, ref(x, w), f"y {m}x{n}x{k}")
    check_outside_untouched(buf, y, "y")
    c = mla_decode.projections.gemm_config(x, w, y)
    assert c.bm >= m and c.bn in (128, 256) and 1 <= c.splits <= 8 and c.stages >= 2 and c.blocks >= 1
    assert 1 <= c.group <= c.stages
    assert (c.ws_bytes > 0) == (c.splits > 1), f"split-K workspace {c.ws_bytes} bytes with {c.splits} splits"


def test_two_weights_in_one_launch():
    g = torch.Generator(device="cuda").manual_seed(5)
    m, k = 128, 7168
    x = rand(m, k, g=g)
    w_big = rand(1536 + 576 + 64, k, g=g, scale=k ** -0.5)  # the weights as views of one buffer, rows apart
    w0, w1 = w_big[:1536], w_big[1536 + 64:]
    b0, y0 = nan_padded(m, 1536)
    b1, y1 = nan_padded(m, 576)
    torch.ops.mla_decode.gemm_nt(x, w0, y0, w1, y1)
    assert_task_rule(y0, ref(x, w0), "y0")
    assert_task_rule(y1, ref(x, w1), "y1")
    check_outside_untouched(b0, y0, "y0")
    check_outside_untouched(b1, y1, "y1")


@pytest.mark.parametrize("bs", [1, 32, 128])
def test_batched_per_head_views(bs):
    """The output stage's W_UV: x = o [bs, H, r] read per head, W = rows of W_kv_up, y = obuf [bs, H, v] per head."""
    g = torch.Generator(device="cuda").manual_seed(bs)
    H, nope, v, r = 16, 128, 128, 512
    o = rand(bs, H, r, g=g)
    wkv = rand(H, nope + v, r, g=g, scale=r ** -0.5)
    obuf = torch.full((bs, H, v), float("nan"), dtype=torch.bfloat16, device="cuda")
    x, w, y = o.transpose(0, 1), wkv[:, nope:], obuf.transpose(0, 1)
    torch.ops.mla_decode.gemm_nt(x, w, y)
    assert_task_rule(obuf, ref(x, w).transpose(0, 1), "obuf")


def test_rows_placed_by_the_device():
    """Segment 1's row m goes to cache[m, row_pos[m] - 1]; rows whose position is outside the cache are skipped."""
    g = torch.Generator(device="cuda").manual_seed(11)
    m, k, L = 6, 512, 10
    x = rand(m, k, g=g)
    w0, w1 = rand(128, k, g=g, scale=k ** -0.5), rand(576, k, g=g, scale=k ** -0.5)
    y0 = torch.full((m, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    cache = torch.full((m, L, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    pos = torch.tensor([1, 4, 10, 0, 11, 7], dtype=torch.int32, device="cuda")  # row 3 and 4 land nowhere
    torch.ops.mla_decode.gemm_nt(x, w0, y0, w1, cache, pos)
    assert_task_rule(y0, ref(x, w0), "y0")
    r1 = ref(x, w1)
    want = torch.full_like(cache, float("nan"))
    for i, p in enumerate(pos.tolist()):
        if 1 <= p <= L:
            want[i, p - 1] = r1[i]
    assert_task_rule(cache, want, "cache")


def test_bad_operands_raise_and_write_nothing():
    x = torch.zeros(257, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(64, 64, dtype=torch.bfloat16, device="cuda")
    y = torch.full((257, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="1 to 256 rows"):
        torch.ops.mla_decode.gemm_nt(x, w, y)
    with pytest.raises(ValueError, match="1 to 256 rows"):
        torch.ops.mla_decode.gemm_nt(x[:0], w, y[:0])
    with pytest.raises(ValueError, match="x's k"):
        torch.ops.mla_decode.gemm_nt(x[:4], w[:, :32], y[:4])
    with pytest.raises(ValueError, match=r"\[m, n\]"):
        torch.ops.mla_decode.gemm_nt(x[:4], w, y[:5])
    buf = torch.zeros(4 * 64 + 1, dtype=torch.bfloat16, device="cuda")
    xm = buf[1:].view(4, 64)  # 2-byte aligned base
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        torch.ops.mla_decode.gemm_nt(xm, w, y[:4])
    assert torch.isnan(y).all()
    with pytest.raises(TypeError, match="x must be"):
        torch.ops.mla_decode.gemm_nt(x.float(), w, y)


def test_gemm_path_says_which_gemm_runs(gemm_env):
    w = torch.zeros(7168, 16384, dtype=torch.bfloat16, device="cuda")[:, :7168]
    gemm_env(None)
    x = torch.zeros(128, 7168, dtype=torch.bfloat16, device="cuda")
    assert projections.gemm_path(x, w).startswith("vendor: the default")
    assert projections.gemm_path(x, w, own=True) == "sm90"  # the down stage's products
    gemm_env("vendor")
    assert projections.gemm_path(x, w, own=True).startswith("vendor: MLA_DECODE_GEMM=vendor")
    gemm_env("sm90")
    for bs in (1, 32, 128, 256):
        assert projections.gemm_path(x[:bs] if bs <= 128 else x.repeat(2, 1), w) == "sm90"
    assert "x must have 1 to 256 rows" in projections.gemm_path(torch.zeros(257, 7168, dtype=torch.bfloat16, device="cuda"), w)
    xb = torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda")  # a batch the launcher refuses: said, not launched
    wb = torch.zeros(64, 64, dtype=torch.bfloat16, device="cuda")
    assert "batch in [1, 65535]" in projections.gemm_path(xb.expand(65536, 1, 64), wb.expand(65536, 64, 64))


@pytest.mark.parametrize("bs", [1, 128])
def test_stages_on_the_hopper_gemm_match_the_vendor_path(gemm_env, bs):
    """The projection stages with MLA_DECODE_GEMM=sm90 (down in one launch, W_qu, W_UV per head, wo) against float64."""
    from mla_decode.reference import generate_input
    gemm_env("sm90")
    config, x, _ = generate_input(batch_size=bs, prefill=0, max_seq_len=8, seed=900 + bs, device="cuda")
    H, nope, v, r = config.n_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    x2 = x.view(bs, -1)
    q_lora, kv_new = projections.down(x2, config.Q_proj_down_weight, config.KV_proj_down_weight)
    assert_task_rule(q_lora, ref(x2, config.Q_proj_down_weight), "q_lora")
    assert_task_rule(kv_new, ref(x2, config.KV_proj_down_weight), "kv_new")
    wkv = config.KV_proj_up_weight.view(H, nope + v, r)
    o_lat = rand(bs, H, r, g=torch.Generator(device="cuda").manual_seed(bs))
    obuf = torch.full((bs, H, v), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = torch.full((bs, config.dim), float("nan"), dtype=torch.bfloat16, device="cuda")
    projections.output(o_lat, wkv[:, nope:].transpose(1, 2), config.wo_weight, obuf, y)
    ov = bf(torch.einsum("bhr,hvr->bhv", o_lat.double(), wkv[:, nope:].double()))
    assert_task_rule(y, ref(ov.reshape(bs, H * v), config.wo_weight), "y")


@pytest.mark.skipif(not mla_decode.kernels_usable("cuda"), reason=f"needs the GPU kernels: {mla_decode.backend('cuda')}")
def test_stream_read_reads_and_refuses_what_it_cannot():
    """The bare stream bench_projections measures stages against: it reads
    any whole number of 16-byte pieces (here with a tail past the unrolled
    loop), writes nothing the caller owns, and refuses with ValueError what
    it cannot read as 16-byte pieces."""
    buf = torch.randint(0, 255, (30 * 2**20 + 48,), dtype=torch.uint8, device="cuda")
    before = buf.clone()
    torch.ops.mla_decode.stream_read(buf)
    torch.cuda.synchronize()
    assert torch.equal(buf, before)
    for bad in (buf[1:17], buf[:24], buf.view(-1, 16)[:, :8]):
        with pytest.raises(ValueError):
            torch.ops.mla_decode.stream_read(bad)
