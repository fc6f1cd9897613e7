"""The Hopper fused query (torch.ops.mla_decode.query_fused): per head,
q = q_lora W_qu^T rounded to bf16, q_abs = q_nope W_UK rounded, q_pe = q's
rope columns, against float64 evaluations of the same bf16 inputs rounded
where the task rounds, with fresh random inputs, outputs written into
NaN-filled buffers larger than the result (nothing outside it may change).
Runs where the Hopper kernels do (an sm_90a build on a compute 9.x GPU)."""

import pytest
import torch

from mla_decode import projections

from conftest import assert_task_rule
from test_gpu_gemm import bf, needs_hopper, rand

pytestmark = [needs_hopper, pytest.mark.gpu]


def operands(m, heads, k, r=512, nope=128, rope=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_lora = rand(m, k, g=g)
    w_qu = rand(heads * (nope + rope), k, g=g, scale=k ** -0.5)
    # W_UK as the decoder takes it: a strided view of W_kv_up [heads, nope + v, r]
    wkv = rand(heads, nope + 128, r, g=g, scale=nope ** -0.5)
    return q_lora, w_qu, wkv[:, :nope]


def reference(q_lora, w_qu, w_uk):
    heads, nope, _ = w_uk.shape
    q = bf(q_lora.double() @ w_qu.double().T).view(q_lora.shape[0], heads, -1)
    q_abs = bf(torch.einsum("bhn,hnr->hbr", q[..., :nope].double(), w_uk.double()))
    return q_abs, q[..., nope:]


@pytest.mark.parametrize("m,heads,k", [(1, 128, 1536), (32, 128, 1536), (64, 16, 1536), (65, 8, 1000),
                                       (128, 128, 1536), (128, 64, 1536), (100, 3, 72)])
def test_fused_query_matches_float64(m, heads, k):
    q_lora, w_qu, w_uk = operands(m, heads, k, seed=m + heads + k)
    r = w_uk.shape[2]
    # q_abs inside a NaN-filled [heads, m + 2, r + 64 + 8] buffer, as the decoder's qbuf (with room around it)
    qa_buf = torch.full((heads, m + 2, r + 72), float("nan"), dtype=torch.bfloat16, device="cuda")
    q_abs = qa_buf[:, 1:m + 1, :r]
    qp_buf = torch.full((m, heads, 72), float("nan"), dtype=torch.bfloat16, device="cuda")
    q_pe = qp_buf[:, :, :64]
    torch.ops.mla_decode.query_fused(q_lora, w_qu, w_uk, q_abs, q_pe, False)
    want_abs, want_pe = reference(q_lora, w_qu, w_uk)
    assert_task_rule(q_abs, want_abs, f"q_abs m{m} H{heads} k{k}")
    assert_task_rule(q_pe, want_pe, f"q_pe m{m} H{heads} k{k}")
    outside = torch.ones_like(qa_buf, dtype=torch.bool)
    outside[:, 1:m + 1, :r] = False
    assert torch.isnan(qa_buf[outside]).all(), "the fused query wrote outside q_abs"
    assert torch.isnan(qp_buf[:, :, 64:]).all(), "the fused query wrote outside q_pe"


def test_query_stage_takes_the_fused_kernel_on_hopper():
    heads = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count  # >= 3/4 of the SMs
    q_lora, w_qu, w_uk = operands(128, heads, 1536)
    qbuf = torch.full((heads, 128, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert projections.query_path(q_lora, w_qu, w_uk, qbuf) == "sm90"
    q_pe = projections.query(q_lora, w_qu, w_uk, qbuf)
    want_abs, want_pe = reference(q_lora, w_qu, w_uk)
    assert_task_rule(qbuf[:, :, :512], want_abs, "q_abs")
    assert_task_rule(q_pe, want_pe, "q_pe")
    assert torch.isnan(qbuf[:, :, 512:]).all(), "query wrote the rope columns"


def test_query_path_says_why_not(gemm_env):
    q_lora, w_qu, w_uk = operands(129, 4, 256)
    qbuf = torch.empty(4, 129, 576, dtype=torch.bfloat16, device="cuda")
    assert "1 to 128 rows" in projections.query_path(q_lora, w_qu, w_uk, qbuf)
    q_lora, w_qu, w_uk = operands(8, 4, 256, nope=64)
    assert "128 nope" in projections.query_path(q_lora, w_qu, w_uk, qbuf[:, :8])
    q_lora, w_qu, w_uk = operands(8, 4, 256)
    assert "4 heads on" in projections.query_path(q_lora, w_qu, w_uk, qbuf[:, :8])
    gemm_env("vendor")
    assert projections.query_path(q_lora, w_qu, w_uk, qbuf[:, :8]) == "vendor: MLA_DECODE_GEMM=vendor"


def test_fused_query_checks_its_operands():
    q_lora, w_qu, w_uk = operands(8, 4, 256)
    q_abs = torch.empty(4, 8, 512, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.empty(8, 4, 64, dtype=torch.bfloat16, device="cuda")
    op = torch.ops.mla_decode.query_fused
    with pytest.raises(ValueError, match=r"q_abs.*\[heads, m, r\]"):
        op(q_lora, w_qu, w_uk, q_abs[:, :7], q_pe, False)
    with pytest.raises(ValueError, match="q_pe"):
        op(q_lora, w_qu, w_uk, q_abs, q_pe[:, :, :32], False)
    with pytest.raises(ValueError, match="w_qu"):
        op(q_lora, w_qu[:-1], w_uk, q_abs, q_pe, False)
    with pytest.raises(TypeError, match="q_lora"):
        op(q_lora.float(), w_qu, w_uk, q_abs, q_pe, False)
    big = rand(129, 256, g=torch.Generator(device="cuda").manual_seed(1))
    with pytest.raises(ValueError, match="1 to 128 rows"):
        op(big, w_qu, w_uk, torch.empty(4, 129, 512, dtype=torch.bfloat16, device="cuda"),
           torch.empty(129, 4, 64, dtype=torch.bfloat16, device="cuda"), False)
    q2, w2, uk2 = operands(8, 4, 256, nope=64)
    with pytest.raises(ValueError, match="128 nope"):
        op(q2, w2, uk2, q_abs, torch.empty(8, 4, 64, dtype=torch.bfloat16, device="cuda"), False)


@pytest.mark.parametrize("m,heads,k", [(1, 128, 1536), (32, 128, 1536), (128, 128, 1536), (100, 3, 72)])
def test_fused_query_append_matches_the_two_stages(m, heads, k):
    """With kv_new / seqlens / rope_cs / cache (/ kpe_out), the one launch
    rotates q_pe and appends the cache row as rope_append does after the plain
    fused query: the same bits everywhere (rope_append's own exactness is
    tested against PyTorch in test_projections.py), NaN-filled buffers
    untouched elsewhere, and sequences whose position lies outside the cache
    left alone in both."""
    from mla_decode.attention import rope_table

    q_lora, w_qu, w_uk = operands(m, heads, k, seed=7 * m + heads)
    r, L = w_uk.shape[2], 40
    g = torch.Generator(device="cuda").manual_seed(m + k)
    kv_new = rand(m, r + 64, g=g)
    lens = torch.randint(1, L + 1, (m,), generator=g, device="cuda", dtype=torch.int32)
    if m > 2:
        lens[1] = 0        # position -1: nothing written
        lens[2] = L + 1    # past the cache: nothing written
    table = rope_table(L, 64, "cuda")

    def buffers():
        nan = float("nan")
        return (torch.full((heads, m, r + 64), nan, dtype=torch.bfloat16, device="cuda"),
                torch.full((m, L, r + 64), nan, dtype=torch.bfloat16, device="cuda"),
                torch.full((m, L + 2, 64), nan, dtype=torch.bfloat16, device="cuda"))

    # the two stages: the fused query (un-rotated q_pe), then the rope_append kernel
    qbuf_a, cache_a, kpe_a = buffers()
    q_pe = torch.empty(m, heads, 64, dtype=torch.bfloat16, device="cuda")
    torch.ops.mla_decode.query_fused(q_lora, w_qu, w_uk, qbuf_a[:, :, :r], q_pe, False)
    torch.ops.mla_decode.rope_append(q_pe, kv_new, lens, table, qbuf_a[:, :, r:].transpose(0, 1), cache_a, kpe_a)
    # one launch
    qbuf_b, cache_b, kpe_b = buffers()
    torch.ops.mla_decode.query_fused(q_lora, w_qu, w_uk, qbuf_b[:, :, :r], qbuf_b[:, :, r:].transpose(0, 1), False,
                                     kv_new, lens, table, cache_b, kpe_b)
    for name, a, b in (("qbuf", qbuf_a, qbuf_b), ("cache", cache_a, cache_b), ("kpe", kpe_a, kpe_b)):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True, msg=lambda s: f"{name}: {s}")
    valid = (lens >= 1) & (lens <= L)
    assert not torch.isnan(qbuf_b[:, valid, r:]).any(), "rotated q_pe missing"
    assert torch.isnan(qbuf_b[:, ~valid, r:]).all(), "q_pe written for a sequence outside the cache"
    rows = torch.arange(m, device="cuda")[valid]
    assert torch.equal(cache_b[rows, lens[valid].long() - 1], kv_new[valid]), "cache row"
    # the decoder's path: query_rope_append takes the one launch where query_path says sm90
    if projections.query_path(q_lora, w_qu, w_uk, qbuf_b) == "sm90":
        qbuf_c, cache_c, kpe_c = buffers()
        q_att = projections.query_rope_append(q_lora, w_qu, w_uk, kv_new, lens, (table, None, None), qbuf_c, cache_c,
                                              kpe=kpe_c)
        assert q_att.data_ptr() == qbuf_c.data_ptr() and q_att.shape == (m, 1, heads, r + 64)
        torch.testing.assert_close(qbuf_c, qbuf_a, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(cache_c, cache_a, rtol=0, atol=0, equal_nan=True)


def test_fused_query_append_checks_its_operands():
    q_lora, w_qu, w_uk = operands(8, 4, 256)
    q_abs = torch.empty(4, 8, 512, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.empty(8, 4, 64, dtype=torch.bfloat16, device="cuda")
    kv_new = torch.zeros(8, 576, dtype=torch.bfloat16, device="cuda")
    cache = torch.full((8, 16, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    lens = torch.ones(8, dtype=torch.int32, device="cuda")
    cs = torch.zeros(16, 64, dtype=torch.bfloat16, device="cuda")
    op = torch.ops.mla_decode.query_fused
    with pytest.raises(ValueError, match="together"):
        op(q_lora, w_qu, w_uk, q_abs, q_pe, False, kv_new, lens, cs)
    with pytest.raises(ValueError, match="cover every cache position"):
        op(q_lora, w_qu, w_uk, q_abs, q_pe, False, kv_new, lens, cs[:8], cache)
    with pytest.raises(ValueError, match=r"cache must have shape \[bs, max_seq_len, width\]"):
        op(q_lora, w_qu, w_uk, q_abs, q_pe, False, kv_new, lens, cs, cache[:, :, :512])
    with pytest.raises(TypeError, match="seqlens"):
        op(q_lora, w_qu, w_uk, q_abs, q_pe, False, kv_new, lens.long(), cs, cache)
    torch.cuda.synchronize()
    assert torch.isnan(cache).all(), "a failed check wrote the cache"
