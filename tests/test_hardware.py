"""The dtype `auto` picks for each kind of hardware, and `memstream env`'s report of it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from connectors.engines import hardware
from connectors.engines.factory import EngineSpec
from connectors.engines.hardware import Gpu, Hardware, auto_dtype, resolve_dtype
from connectors.engines.vllm_local import VLLMEngineConfig

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512_NO_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512_vnni"}
AVX512_BF16 = AVX512_NO_BF16 | {"avx512_bf16"}
SAPPHIRE_RAPIDS = AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}
AMX_ONLY = AVX2_ONLY | {"amx_bf16", "amx_tile"}
ARM_NEOVERSE = frozenset({"fp", "asimd", "sve", "bf16"})


def cpu(flags: frozenset[str]) -> Hardware:
    return Hardware(cpu_model="test CPU", cores=2, cpu_flags=flags)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (AVX2_ONLY, "float32"),
        (AVX512_NO_BF16, "float32"),
        (AVX512_BF16, "bfloat16"),
        (SAPPHIRE_RAPIDS, "bfloat16"),
        (AMX_ONLY, "bfloat16"),
        (ARM_NEOVERSE, "float32"),
        (frozenset(), "float32"),
    ],
)
def test_auto_picks_bfloat16_only_on_cpus_with_native_bf16(
    flags: frozenset[str], expected: str
) -> None:
    assert auto_dtype(cpu(flags)) == expected
    assert resolve_dtype("auto", cpu(flags), environ={}) == expected


@pytest.mark.parametrize(
    ("capabilities", "expected"),
    [([(8, 0)], "bfloat16"), ([(9, 0), (8, 6)], "bfloat16"), ([(7, 5)], "float16"),
     ([(8, 0), (7, 0)], "float16")],
)  # fmt: skip
def test_auto_on_gpus_is_bfloat16_from_compute_capability_8(
    capabilities: list[tuple[int, int]], expected: str
) -> None:
    machine = Hardware("host", 8, AVX2_ONLY, tuple(Gpu("gpu", c) for c in capabilities))
    assert resolve_dtype("auto", machine, environ={}) == expected


def test_the_environment_overrides_auto_but_not_a_named_dtype() -> None:
    machine = cpu(AVX2_ONLY)
    assert resolve_dtype("auto", machine, environ={"MEMSTREAM_DTYPE": "bfloat16"}) == "bfloat16"
    assert resolve_dtype("float16", machine, environ={"MEMSTREAM_DTYPE": "bfloat16"}) == "float16"
    assert resolve_dtype("auto", machine, environ={"MEMSTREAM_DTYPE": ""}) == "float32"
    with pytest.raises(ValueError, match="MEMSTREAM_DTYPE='fp8'"):
        resolve_dtype("auto", machine, environ={"MEMSTREAM_DTYPE": "fp8"})
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineSpec(dtype="half")


def test_the_gpu_share_an_engine_reserves_comes_from_the_environment_unless_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = hardware.GPU_MEMORY_ENV
    assert hardware.default_gpu_memory_utilization({}) == 0.9
    assert hardware.default_gpu_memory_utilization({env: "0.25"}) == 0.25
    for bad in ("0", "1.5", "a quarter"):
        with pytest.raises(ValueError, match=f"{env}='{bad}': must be a share"):
            hardware.default_gpu_memory_utilization({env: bad})
    monkeypatch.setenv(env, "0.3")
    assert EngineSpec().gpu_memory_utilization == 0.3
    assert VLLMEngineConfig(model="m").engine_args()["gpu_memory_utilization"] == 0.3
    assert EngineSpec(gpu_memory_utilization=0.8).gpu_memory_utilization == 0.8


def test_forcing_bfloat16_on_a_cpu_that_emulates_it_warns_once_with_the_cost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hardware._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger=hardware.__name__):
        for _ in range(3):
            assert resolve_dtype("bfloat16", cpu(AVX2_ONLY), environ={}) == "bfloat16"
        assert resolve_dtype("bfloat16", cpu(AVX512_BF16), environ={}) == "bfloat16"
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1
    assert "emulated" in warnings[0] and "24 tokens/s" in warnings[0]


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 fma\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 fma\n"
    )
    assert hardware._cpuinfo(cpuinfo) == ("AMD EPYC 7B13", frozenset({"fpu", "sse", "avx2", "fma"}))
    assert hardware._cpuinfo(tmp_path / "missing") == ("", frozenset())


def test_a_resolved_spec_is_concrete_and_an_http_engine_keeps_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MEMSTREAM_DTYPE", "float16")
    assert EngineSpec().resolved().dtype == "float16"
    assert EngineSpec(dtype="bfloat16").resolved().dtype == "bfloat16"
    http = EngineSpec(kind="openai", base_url="http://127.0.0.1:1/v1")
    assert http.resolved().dtype == "auto"


def test_a_job_with_gpu_actors_assumes_a_modern_gpu_where_its_driver_has_none() -> None:
    driver = cpu(AVX2_ONLY)
    assert resolve_dtype("auto", hardware.with_gpu_workers(driver), environ={}) == "bfloat16"
    old_gpu = Hardware("host", 8, AVX2_ONLY, (Gpu("T4", (7, 5)),))
    assert hardware.with_gpu_workers(old_gpu) == old_gpu


def test_eager_or_compiled_follows_the_work_planned_unless_named() -> None:
    from connectors.engines.factory import COMPILE_PAYS_OFF_TOKENS

    small, large = COMPILE_PAYS_OFF_TOKENS - 1, COMPILE_PAYS_OFF_TOKENS
    assert EngineSpec().resolved(planned_tokens=small).enforce_eager is True
    assert EngineSpec().resolved(planned_tokens=large).enforce_eager is False
    assert EngineSpec().resolved().enforce_eager is False  # unknown work: a long-lived server
    assert EngineSpec(enforce_eager=False).resolved(planned_tokens=10).enforce_eager is False
    assert EngineSpec(enforce_eager=True).resolved(planned_tokens=large).enforce_eager is True


def test_prompt_lookup_is_on_for_a_few_chains_in_16_bits_unless_named() -> None:
    from connectors.engines.factory import PROMPT_LOOKUP_MAX_CHAINS, PROMPT_LOOKUP_TOKENS

    few, many = PROMPT_LOOKUP_MAX_CHAINS, PROMPT_LOOKUP_MAX_CHAINS + 1
    bf16 = EngineSpec(dtype="bfloat16")
    assert bf16.resolved(planned_chains=few).prompt_lookup_tokens == PROMPT_LOOKUP_TOKENS
    assert bf16.resolved(planned_chains=many).prompt_lookup_tokens == 0
    assert bf16.resolved().prompt_lookup_tokens == 0  # a server or a corpus job
    assert EngineSpec(dtype="float32").resolved(planned_chains=1).prompt_lookup_tokens == 0
    assert EngineSpec(prompt_lookup_tokens=0, dtype="bfloat16").lookup_for(1) == 0
    on_avx2 = EngineSpec().resolved(cpu(AVX2_ONLY), planned_chains=1)
    assert (on_avx2.dtype, on_avx2.prompt_lookup_tokens) == ("float32", 0)
    named = EngineSpec(prompt_lookup_tokens=2).resolved(planned_chains=many)
    assert named.prompt_lookup_tokens == 2
    assert named.describe().endswith("prompt lookup 2")
    assert "lookup" not in EngineSpec(prompt_lookup_tokens=0).resolved().describe()
