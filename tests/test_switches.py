"""The C++ side's environment switches (csrc/platform/switches.h): read in
one place, once per process, each with its default where unset. Runs where
the extension is built (no GPU needed): each case is a fresh process with
its own environment."""

import json
import os
import subprocess
import sys

import pytest

import mla_decode

pytestmark = pytest.mark.skipif(not mla_decode._ext.kernels_built(), reason="the extension is not built here")

DEFAULTS = dict(attn_kernel="", portable_rows=0, plan_p0=False, tma=True, persist=True, attn_ctas=0, pdl=True,
                gemm_mw=0, gemm_splits=0, gemm_group=0, step_graph=True, step_graph_trace=0)

READ = "import json, mla_decode; print(json.dumps(mla_decode._ext.module().switches()))"


def switches_in(env, code=READ):
    """The switches a fresh process reads with env (every other MLA_DECODE_* unset)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DECODE_")}
    e.update(env)
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_defaults_where_unset():
    assert switches_in({}) == DEFAULTS


def test_each_switch_is_read():
    env = {"MLA_DECODE_ATTN_KERNEL": "portable", "MLA_DECODE_PORTABLE_ROWS": "32", "MLA_DECODE_PLAN_P0": "1",
           "MLA_DECODE_TMA": "0", "MLA_DECODE_PERSIST": "0", "MLA_DECODE_ATTN_CTAS": "100", "MLA_DECODE_PDL": "0",
           "MLA_DECODE_GEMM_MW": "1", "MLA_DECODE_GEMM_SPLITS": "3", "MLA_DECODE_GEMM_GROUP": "2",
           "MLA_DECODE_STEP_GRAPH": "0", "MLA_DECODE_STEP_GRAPH_TRACE": "2"}
    assert switches_in(env) == dict(attn_kernel="portable", portable_rows=32, plan_p0=True, tma=False, persist=False,
                                    attn_ctas=100, pdl=False, gemm_mw=1, gemm_splits=3, gemm_group=2,
                                    step_graph=False, step_graph_trace=2)


def test_off_switches_take_only_zero_and_are_read_once():
    # "=0" switches: any other value keeps the default; PLAN_P0 only "1"
    code = ("import json, os, mla_decode\n"
            "C = mla_decode._ext.module()\n"
            "a = C.switches()\n"
            "os.environ['MLA_DECODE_TMA'] = '0'\n"  # too late: read once, at the first call
            "b = C.switches()\n"
            "print(json.dumps(dict(a=a, same=a == b)))")
    r = switches_in({"MLA_DECODE_PDL": "1", "MLA_DECODE_TMA": "off", "MLA_DECODE_PLAN_P0": "0"}, code)
    assert r["same"] and r["a"] == DEFAULTS


def test_the_lean_path_reads_the_names_validate_defines():
    # one definition (mla_decode.validate): fast_step reads the cache's and the config's attributes by these names
    from mla_decode import decoder, validate  # noqa: F401 (importing the decoder gives the extension the names)
    names = mla_decode._ext.module().step_names()
    assert tuple(names) == validate.CACHE_FIELDS + validate.WEIGHTS + validate.CONFIG_DIMS
    with pytest.raises(ValueError, match="set_step_names"):
        mla_decode._ext.module().set_step_names(["data"])
    assert tuple(mla_decode._ext.module().step_names()) == tuple(names)


def test_the_step_path_bits_come_from_the_extension():
    # one definition (csrc/api/ops.h): decode_step's `want`, its report and MLADecoder.last_paths read the same bits
    from mla_decode import kernel_choice
    bits = mla_decode._ext.module().step_bits()
    assert set(bits) == {"down_own", "query_fused", "wo_lt", "graph", "captured", "plan_in_query"}
    values = sorted(bits.values())
    assert len(set(values)) == 6 and all(v > 0 and v & (v - 1) == 0 for v in values)
    assert all(kernel_choice.step_bit(n) == v for n, v in bits.items())
    paths = kernel_choice.describe_step_paths(bits["down_own"] | bits["graph"])
    assert paths == dict(down="sm90 GEMM", query="vendor BLAS + rope_append", plan="planner kernel",
                         wo="vendor BLAS (PyTorch default)", launch="graph replay", captured=False)
    everything = kernel_choice.describe_step_paths(sum(values))
    assert everything == dict(down="sm90 GEMM", query="fused sm90 query", plan="fused query", wo="cuBLASLt",
                              launch="graph replay", captured=True)


def test_the_hopper_kernels_size_rules_come_from_the_extension():
    # one definition (gemm_sm90.cu, query_sm90.cu): kernel_choice's reasons are the launchers' own refusals
    m = mla_decode._ext.module()
    assert m.gemm_sm90_sizes(1, 7168, 1536, 576) is None and m.gemm_sm90_sizes(256, 7168, 64) is None
    assert "1 to 256 rows" in m.gemm_sm90_sizes(257, 7168, 1536)
    assert "1 to 256 rows" in m.gemm_sm90_sizes(0, 7168, 1536)
    assert "multiple of 8 rows, at least 64" in m.gemm_sm90_sizes(8, 7168, 1536, 60)
    assert "multiple of 8 rows, at least 64" in m.gemm_sm90_sizes(8, 7168, 1540)
    assert "batch in [1, 65535]" in m.gemm_sm90_sizes(8, 64, 64, batch=65536)  # (kernel_choice.gemm_path passes x's)
    assert m.query_sm90_sizes(128, 1536, 128, 128, 64, 512) is None
    assert "1 to 128 rows" in m.query_sm90_sizes(129, 1536, 128, 128, 64, 512)
    assert "128 nope + 64 rope" in m.query_sm90_sizes(8, 1536, 128, 64, 64, 512)
    assert "multiple of 128" in m.query_sm90_sizes(8, 1536, 128, 128, 64, 500)
