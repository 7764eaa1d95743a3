"""The CPU facts a manifest and a report record (parity_tests.running.cpu)."""

from __future__ import annotations

import json

import pytest

from parity_tests.running.cpu import FLAGS, NUMERIC_ENV, cpu_facts, onednn_isa, read_cpuinfo

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B45
flags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni
processor\t: 1
model name\t: something else
flags\t\t: fpu
"""


def test_cpuinfo_gives_the_first_processors_model_and_flags():
    info = read_cpuinfo(CPUINFO)
    assert info["model"] == "AMD EPYC 9B45"
    assert info["flags"] == ["fpu", "sse", "avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"]
    assert read_cpuinfo("") == {"model": None, "flags": []}


@pytest.mark.parametrize(("flags", "cap", "want"), [
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, None, "avx512_core_amx"),
    ({"avx2", "avx512f", "avx512_bf16"}, None, "avx512_core_bf16"),
    ({"avx2", "avx512f"}, None, "avx512_core"),
    ({"avx2"}, None, "avx2"),
    (set(), None, "sse41"),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512_CORE", "avx512_core"),  # the cap the issue tried
    ({"avx2", "avx512f", "avx512_bf16"}, "avx2", "avx2"),
    ({"avx2"}, "AVX512_CORE_AMX", "avx2"),  # a cap above the CPU changes nothing
    ({"avx2", "avx512f"}, "no-such-isa", "avx512_core"),  # oneDNN ignores a name it does not know
])
def test_the_onednn_isa_is_the_best_the_flags_allow_under_the_cap(flags, cap, want):
    assert onednn_isa(flags, cap) == want


def test_facts_are_json_and_follow_the_settings(monkeypatch):
    for k in NUMERIC_ENV:
        monkeypatch.delenv(k, raising=False)
    facts = cpu_facts()
    assert json.loads(json.dumps(facts)) == facts
    assert set(facts["flags"]) == set(FLAGS) and all(isinstance(v, bool) for v in facts["flags"].values())
    assert set(facts["env"]) == set(NUMERIC_ENV) and all(v is None for v in facts["env"].values())
    avx512 = facts["flags"]["avx512f"] or facts["flags"]["avx_ne_convert"]
    assert facts["tf_onednn_bfloat16"] == avx512  # TensorFlow's own test: AVX512F or AVX_NE_CONVERT
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")
    capped = cpu_facts()
    assert capped["tf_onednn_bfloat16"] is False and capped["onednn_isa"] == "sse41"
    assert capped["env"]["TF_ENABLE_ONEDNN_OPTS"] == "0"
