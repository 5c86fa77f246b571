"""scripts/gpu_check.sh (-> scripts/gpu_check.py, benchmarks/device_check_*.py, attention_checks.py): the
GPU check's code path on CPU with tiny shapes (SDPA training, flex only in the mask checks, FSDP2 over
gloo) with the modules the bare GPU machine lacks made unimportable; its supervisor (per-unit timeouts,
rows written as they finish) against a fake worker; its instruments against planted faults. The CUDA
run itself needs an H100/H200 (see the script)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from benchmarks import attention_checks as checks
from benchmarks.device_check_runner import Report, Unit, supervise
from drafters.common.attention import attend
from drafters.common.masks import AttentionMask, ttt_attention_mask

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
FAMILIES = ("eagle1", "eagle2", "eagle3", "dflash", "dspark", "domino", "peagle")
# benchmarks/device_checks.py's checks but flex_compiles: inductor compiles its graphs to C++ here (~40 s on 2
# cores); tests/drafters/test_flex_compiles.py runs the same function (slow), its verdict is tested below
CHECKS = ("capture_wait", "online_round", "dflash_rebuild", "speculation_roofline")
# what the GPU machine (torch, transformers, safetensors, numpy, pyyaml, triton) does not have, and
# heavy optional packages the check has no business importing
ABSENT = ("omegaconf", "hydra", "antlr4", "vllm", "ray", "verl", "sglang", "tqdm", "accelerate", "speculators",
          "peft", "datasets", "tensordict", "torchdata", "pandas", "matplotlib")
BLOCKER = f"""import sys
ABSENT = frozenset({ABSENT!r})
class _Absent:  # every finder answers None for these names: find_spec is None, import raises
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            return None
        return self.inner.find_spec(name, path, target)
    def __getattr__(self, item):
        return getattr(self.inner, item)
sys.meta_path[:] = [_Absent(f) for f in sys.meta_path]
"""


def bare_machine_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine without ABSENT: a sitecustomize that hides them from every import."""
    site = tmp_path / "bare_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHON": str(ROOT / ".venv" / "bin" / "python"), "PYTHONPATH": str(site)}
    return env


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = env or {**os.environ, "PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env)


def test_cpu_smoke_run_on_a_bare_machine_steps_every_family(tmp_path: Path) -> None:
    env = bare_machine_env(tmp_path)
    probe = subprocess.run([env["PYTHON"], "-c", "import omegaconf"], env=env,
                           capture_output=True, text=True)
    assert "No module named 'omegaconf'" in probe.stderr  # the blocker is in force
    report = tmp_path / "report.json"
    proc = run("--device", "cpu", "--tiny", "--steps", "1", "--checks", ",".join(CHECKS), "--json", str(report), env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(report.read_text())
    assert data["complete"] and data["backend"] == "gloo" and data["device"] == "cpu"
    rows = {r["unit"]: r for r in data["rows"] if r["kind"] == "family"}
    assert tuple(sorted(rows)) == tuple(sorted(FAMILIES))
    for name, r in rows.items():
        assert r["status"] == "ok" and r["ok"] and all(math.isfinite(x) for x in r["losses"]), (name, r)
        assert r["step_ms"] > 0 and r["flops_per_step"] > 0 and r["mfu"] is None and r["peak_gib"] is None, name
        assert r["masks"] and all(m["elementwise"] and m["blocks"] and m["outputs"] for m in r["masks"]), name
        assert r["flex_calls"] == 0  # CPU trains with SDPA; flex runs in the mask checks only
    assert len(rows["eagle3"]["masks"]) == 7  # one TTT mask per step: the recorder sees every attention call
    assert rows["eagle2"]["same_as"] == "eagle1"
    assert {k: v for k, v in rows["eagle2"].items() if k not in ("unit", "same_as")} == \
        {k: v for k, v in rows["eagle1"].items() if k != "unit"}
    assert "eagle2*" in proc.stdout and "MFU" in proc.stdout and "within" in proc.stdout
    assert all(f"[gpu_check] {name} (family): OK" in proc.stdout for name in FAMILIES)
    named = {r["unit"]: r for r in data["rows"] if r["kind"] == "check"}
    assert [r["unit"] for r in data["rows"]][-len(CHECKS):] == list(CHECKS) and all(r["ok"] for r in named.values())
    # on the CPU nothing is in flight and nothing moves to another device: no event, float32, no head moves
    assert named["capture_wait"]["rows_equal"] and named["capture_wait"]["event"] is None
    online = named["online_round"]
    assert online["compute_dtypes"] == online["master_dtypes"] == ["float32"] and online["head_moves"] == 0
    assert online["trained"] and math.isfinite(online["loss"])
    assert named["dflash_rebuild"]["cases"] == 12 and not named["dflash_rebuild"]["failed"]  # tp 2 and 4, 2 states


TINY_SHAPES = argparse.Namespace(layers=1, heads=4, kv_heads=2, hidden=64, seed=0)


def test_dflash_check_fails_a_rebuild_from_the_whole_checkpoint_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuild before the tensor-parallel fix stacked every kv head's rows on every rank."""
    from benchmarks.device_checks_kernels import dflash_rebuild
    from verl_speco.engines import vllm_reload

    assert dflash_rebuild(TINY_SHAPES, torch.device("cpu"))["ok"]

    def whole(attn: object, tensors: dict[str, torch.Tensor], layer: int, kind: str) -> torch.Tensor:
        return torch.cat([tensors[f"layers.{layer}.self_attn.{p}_proj.{kind}"] for p in "kv"])

    monkeypatch.setattr(vllm_reload, "_rank_kv_rows", whole)
    row = dflash_rebuild(TINY_SHAPES, torch.device("cpu"))
    assert not row["ok"] and len(row["failed"]) == row["cases"] == 12, row


@pytest.mark.parametrize(("graphs", "ok"), [((1, 1), True), ((7, 1), False), ((1, 2), False)])
def test_flex_check_passes_one_graph_per_mask_function_only(graphs: tuple[int, int], ok: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict over planted counts (the counting itself: tests/drafters/test_flex_compiles.py); the
    planted run makes the flex calls a real one makes, compared with SDPA."""
    import benchmarks.flex_compiles as flex_compiles
    import drafters.common.attention as attention_module
    from benchmarks.device_checks_kernels import flex_compiles as check

    def planted(device: torch.device, dtype: torch.dtype, backward: bool, seed: int) -> object:
        q = torch.randn(1, 2, 8, 4)
        for _ in range(7 + len(flex_compiles.DFLASH_STEPS)):
            attention_module._flex(q, q, q, None)
        return flex_compiles.FlexCompileCounts(graphs[0], graphs[1], 7, 8)

    monkeypatch.setattr(flex_compiles, "flex_compile_counts", planted)
    row = check(TINY_SHAPES, torch.device("cpu"))
    assert row["ok"] == ok and row["flex_calls"] == 9 and row["flex_failures"] == 0, row


def test_capture_check_fails_rows_read_before_their_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that has not landed (the host buffer still empty) is what an un-awaited read sees."""
    from benchmarks.device_checks_online import capture_wait
    from verl_speco.online import capture as capture_mod

    args = argparse.Namespace(seq_len=64, hidden=16, vocab=100, seed=0)
    assert capture_wait(args, torch.device("cpu"))["ok"]
    monkeypatch.setattr(capture_mod, "_to_host", torch.zeros_like)
    row = capture_wait(args, torch.device("cpu"))
    assert not row["ok"] and not row["rows_equal"], row


def test_units_past_their_timeout_are_recorded_and_the_rest_still_run(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    started = time.perf_counter()  # no worker imports torch within 0.3 s: every family times out
    proc = run("--device", "cpu", "--tiny", "--families", "eagle1,dflash", "--checks", "", "--family-timeout-s", "0.3",
               "--json", str(report))
    assert proc.returncode == 1 and time.perf_counter() - started < 30, proc.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["complete"] and [(r["unit"], r["status"]) for r in data["rows"]] == \
        [("eagle1", "timeout"), ("eagle2", "timeout"), ("dflash", "timeout")]
    assert all(not r["ok"] and r["error"] == "stopped after 0.3 s" for r in data["rows"])


FAKE_WORKER = """import json, os, shutil, subprocess, sys, time
names, events, report, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
def emit(event):
    with open(events, "a") as f:
        f.write(json.dumps(event) + "\\n")
if names[0] == "mute":  # never ready
    time.sleep(60)
emit({"hello": {"device": "fake"}})
for n in names:
    if n.startswith("slow"):  # a child of its own (as torch.compile's workers): must die with the worker
        child = subprocess.Popen(["sleep", "60"])
        open(os.path.join(out, "child"), "w").write(str(child.pid))
        time.sleep(60)
    if n == "crash":
        os._exit(3)
    if n == "snap":  # the report as it stands while this unit runs
        shutil.copy(report, os.path.join(out, "snapshot.json"))
    emit({"unit": n, "row": {"ok": n != "bad", "status": "ok" if n != "bad" else "fail", "wall_s": 0.0}})
"""


def fake_supervise(tmp_path: Path, units: list[Unit], budget_s: float,
                   startup_s: float = 20) -> tuple[Report, list[list[str]]]:
    spawned: list[list[str]] = []
    report = Report(tmp_path / "report.json", budget_s)

    def spawn(names: list[str], events: Path) -> subprocess.Popen[bytes]:
        spawned.append(names)
        return subprocess.Popen([sys.executable, "-c", FAKE_WORKER, json.dumps(names), str(events),
                                 str(report.path), str(tmp_path)], start_new_session=True)

    supervise(units, spawn, tmp_path, report, startup_s, poll_s=0.02)
    return report, spawned


def dead(pid: int) -> bool:
    for _ in range(100):
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.02)
    return False


def test_supervisor_stops_a_slow_unit_with_its_children_and_restarts_after_a_crash(tmp_path: Path) -> None:
    units = [Unit("a", "family", 20), Unit("slow", "family", 1.0), Unit("bad", "check", 20), Unit("crash", "check", 20),
             Unit("snap", "check", 20), Unit("b", "check", 20)]
    report, spawned = fake_supervise(tmp_path, units, budget_s=60)
    assert [(r["unit"], r["kind"], r["status"], r["ok"]) for r in report.rows] == [
        ("a", "family", "ok", True), ("slow", "family", "timeout", False), ("bad", "check", "fail", False),
        ("crash", "check", "crashed", False), ("snap", "check", "ok", True), ("b", "check", "ok", True)]
    assert 1.0 <= report.rows[1]["wall_s"] < 5 and "status 3" in report.rows[3]["error"]
    assert spawned == [["a", "slow", "bad", "crash", "snap", "b"], ["bad", "crash", "snap", "b"], ["snap", "b"]]
    assert dead(int((tmp_path / "child").read_text()))
    snapshot = json.loads((tmp_path / "snapshot.json").read_text())  # written before "snap" ran
    assert not snapshot["complete"] and [r["unit"] for r in snapshot["rows"]] == ["a", "slow", "bad", "crash"]
    assert snapshot["device"] == "fake"


def test_supervisor_stops_at_the_budget_and_records_what_did_not_run(tmp_path: Path) -> None:
    units = [Unit("a", "family", 20), Unit("slow", "family", 20), Unit("b", "family", 20)]
    started = time.perf_counter()
    report, _ = fake_supervise(tmp_path, units, budget_s=2.0)
    assert time.perf_counter() - started < 4
    assert [(r["unit"], r["status"]) for r in report.rows] == [("a", "ok"), ("slow", "timeout"), ("b", "not_run")]
    assert json.loads(report.path.read_text())["rows"] == report.rows  # type: ignore[union-attr]


def test_a_worker_that_never_gets_ready_leaves_every_unit_not_run(tmp_path: Path) -> None:
    started = time.perf_counter()
    report, spawned = fake_supervise(tmp_path, [Unit("mute", "family", 20), Unit("a", "check", 20)], 60, startup_s=0.5)
    assert time.perf_counter() - started < 3 and spawned == [["mute", "a"]]
    assert [(r["unit"], r["status"]) for r in report.rows] == [("mute", "not_run"), ("a", "not_run")]
    assert "was not ready after 0.5 s" in report.rows[0]["error"]


ORPHAN = """import os, sys, time
sys.path.insert(0, sys.argv[1])
from benchmarks.device_check_worker import die_with_parent
die_with_parent()
open(sys.argv[2], "w").write(str(os.getpid()))
time.sleep(60)
"""


def test_a_worker_dies_with_its_supervisor(tmp_path: Path) -> None:
    """The supervisor killed from outside (SIGKILL: none of its cleanup runs) takes its worker along."""
    pid_file = tmp_path / "worker.pid"
    supervisor = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:], "
                                   "start_new_session=True); time.sleep(60)",
                                   sys.executable, "-c", ORPHAN, str(ROOT), str(pid_file)])
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    supervisor.kill()
    supervisor.wait()
    worker = int(pid_file.read_text())
    try:
        assert dead(worker)
    finally:
        if not dead(worker):  # the test's own orphan on failure
            os.kill(worker, signal.SIGKILL)


def test_the_schema_sentinel_is_omegaconfs_missing() -> None:
    """train/config.py spells omegaconf.MISSING itself (so the GPU check imports no omegaconf); Hydra's
    structured config must still read it as a mandatory value."""
    from omegaconf import MISSING, OmegaConf

    from verl_speco.train import config

    assert config.MISSING == MISSING
    assert {"target.path", "data.store"} <= OmegaConf.missing_keys(OmegaConf.structured(config.TrainerConfig))


class WrongDense(AttentionMask):
    """A mask whose dense form disagrees with its mask function (one extra visible pair)."""

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        out = super().dense(device).clone()
        out[0, 0, 0, -1] = True
        return out


def test_mask_check_passes_equal_masks_and_fails_a_planted_difference() -> None:
    valid = torch.ones(2, 300, dtype=torch.bool)
    valid[1, 150:] = False  # a padded row: the block structure is not uniform over the batch
    for good in (ttt_attention_mask(valid, step=0), ttt_attention_mask(valid[:, :200], step=2)):
        result = checks.check_mask(good, torch.device("cpu"))
        assert result.ok and result.max_diff < 1e-4, result
    causal = ttt_attention_mask(valid, step=0)
    # row 0 sees key 299: a pair in the (rows 0-127, keys 256-299) block, which holds no visible pair
    wrong = checks.check_mask(WrongDense(causal.mask_mod, causal.batch, causal.q_len, causal.kv_len),
                              torch.device("cpu"))
    assert not wrong.elementwise and not wrong.blocks and not wrong.outputs and not wrong.ok, wrong


def test_attention_flops_count_visible_pairs_only() -> None:
    causal = ttt_attention_mask(torch.ones(1, 4, dtype=torch.bool), step=0)  # 4 + 3 + 2 + 1 = 10 pairs
    rec = checks.Recorded([(causal, (1, 2, 4, 8)), (causal, (1, 2, 4, 8)), (None, (1, 2, 4, 8))])
    assert checks.attention_flops(rec, torch.device("cpu")) == 3 * 4 * 8 * 2 * (10 + 10 + 16)
    assert len(rec.masks()) == 1


def test_flex_comparison_flags_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8,
                                                                                                       generator=g)
    mask = ttt_attention_mask(torch.ones(1, 40, dtype=torch.bool), step=0)
    with checks.compare_flex_to_dense() as stats:
        attend(q, k, v, mask, "flex")
    assert (stats.calls, stats.failures, stats.dtypes) == (1, 0, {"float32"}) and stats.max_diff < 1e-4
    import drafters.common.attention as attention_module

    monkeypatch.setattr(attention_module, "_flex", lambda q, k, v, mask: torch.zeros_like(q))
    with checks.compare_flex_to_dense() as stats:
        attend(q, k, v, mask, "flex")
    assert stats.failures == 1 and stats.max_diff > 0.1


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_unit_at_its_full_timeout_fits_the_default_budget() -> None:
    script = load_script()
    args = script.parse_args(["--device", "cpu"])
    units = len(args.family_list) * args.family_timeout_s + sum(script.CHECKS[c].timeout_s for c in args.check_list)
    assert args.check_list == list(script.CHECK_NAMES) and units <= args.budget_s == 480


@pytest.mark.parametrize(("flags", "message"), [
    (("--families", "eagle4"), "--families: got ['eagle4']"),
    (("--checks", "nope"), "--checks: got ['nope']"),
    (("--family-timeout-s", "0"), "--family-timeout-s: got 0.0, expected > 0"),
    (("--families", "", "--checks", ""), "both empty")])
def test_a_bad_flag_fails_naming_it(flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_script().parse_args(["--device", "cpu", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
