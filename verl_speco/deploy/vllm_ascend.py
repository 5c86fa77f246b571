"""vllm-ascend, the rollout engine on Ascend NPUs: what release 0.23.0 serves and how we configure it.

Facts of vllm-ascend 0.23.0 (`ASCEND_RELEASE`), each checked against its source, read with `ast`,
by tests/deploy/test_vllm_ascend_source.py (`AscendTree`): `SPEC_METHODS` (the methods its runner
builds a proposer for; no dspark), `MAX_VERIFY_TOKENS` (k + 1 <= 16, its attention builder's limit),
`SPEC_FIELDS_READ` (the `speculative_config` fields its proposers read that we set), and what the
in-place draft reload reaches on it (`RUNNER_DRAFT_ATTR`, `PROPOSER_READS`, `DFLASH_PATCH_BUFFERS`).
`ascend_refusal(method, k)` says why a speculative config cannot run on it (None: it can)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ASCEND_RELEASE = "0.23.0"
SPEC_METHODS = frozenset({"ngram", "ngram_gpu", "suffix", "medusa", "eagle", "eagle3", "mtp", "dflash",
                          "draft_model", "extract_hidden_states"})
MAX_VERIFY_TOKENS = 16
SPEC_FIELDS_READ = frozenset({"method", "num_speculative_tokens", "enforce_eager", "parallel_drafting"})
RUNNER_DRAFT_ATTR = "drafter"
PROPOSER_READS = frozenset({"model", "parallel_drafting", "pass_hidden_states_to_model",
                            "parallel_drafting_hidden_state_tensor", "eagle3_use_aux_hidden_state"})
DFLASH_PATCH_BUFFERS = frozenset({"_fused_kv_weight", "_fused_kv_bias"})
MAIN_BRANCH_ONLY = {"dspark": "DSpark is only on vllm-ascend's main branch, in no release yet"}


def ascend_refusal(method: str, k: int) -> str | None:
    """Why vllm-ascend 0.23.0 cannot run speculative `method` drafting `k` tokens (None: it can)."""
    if method in MAIN_BRANCH_ONLY:
        return f"vllm-ascend {ASCEND_RELEASE} has no speculative method {method!r}: {MAIN_BRANCH_ONLY[method]}"
    if method not in SPEC_METHODS:
        return (f"vllm-ascend {ASCEND_RELEASE} has no speculative method {method!r} "
                f"(its methods: {', '.join(sorted(SPEC_METHODS))})")
    if k + 1 > MAX_VERIFY_TOKENS:
        return (f"num_speculative_tokens={k}: vllm-ascend {ASCEND_RELEASE} verifies at most "
                f"{MAX_VERIFY_TOKENS} tokens per request (k + 1 <= {MAX_VERIFY_TOKENS})")
    return None


class AscendTreeError(ValueError):
    """The directory does not hold vllm-ascend's source, or a fact is no longer where it was."""


class AscendTree:
    """vllm-ascend's source under `root` (the directory holding the `vllm_ascend` package)."""

    def __init__(self, root: str | Path):
        self.package = Path(root) / "vllm_ascend"
        found = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", self._text("_version.py"))
        if found is None:
            raise AscendTreeError(f"{self.package}/_version.py: no __version__ string")
        self.version = found.group(1)

    def _text(self, rel: str) -> str:
        path = self.package / rel
        if not path.is_file():
            raise AscendTreeError(f"{path}: missing, expected vllm-ascend's source (pip download --no-deps)")
        return path.read_text()

    def _ast(self, rel: str) -> ast.Module:
        return ast.parse(self._text(rel), filename=str(self.package / rel))

    def spec_methods(self) -> frozenset[str]:
        """The strings `get_spec_decode_method` compares `method` with (==, in a tuple)."""
        fn = next((n for n in ast.walk(self._ast("spec_decode/__init__.py"))
                   if isinstance(n, ast.FunctionDef) and n.name == "get_spec_decode_method"), None)
        if fn is None:
            raise AscendTreeError(f"{self.package}/spec_decode/__init__.py: no get_spec_decode_method")
        out: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "method":
                for comp in node.comparators:
                    values = comp.elts if isinstance(comp, ast.Tuple) else [comp]
                    out |= {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
        return frozenset(out)

    def verify_limit(self) -> int:
        """N of `assert self.decode_threshold <= N` in the attention metadata builder."""
        for node in ast.walk(self._ast("attention/attention_v1.py")):
            if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and \
                    isinstance(node.test.left, ast.Attribute) and node.test.left.attr == "decode_threshold" and \
                    isinstance(node.test.ops[0], ast.LtE) and isinstance(node.test.comparators[0], ast.Constant) and \
                    isinstance(node.test.comparators[0].value, int):
                return node.test.comparators[0].value
        raise AscendTreeError(f"{self.package}/attention/attention_v1.py: no `assert ...decode_threshold <= N`")

    def speculative_config_reads(self) -> frozenset[str]:
        """Every attribute read off something named `speculative_config` anywhere in the package."""
        out: set[str] = set()
        for path in self.package.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    base = node.value
                    name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else ""
                    if name == "speculative_config":
                        out.add(node.attr)
        return frozenset(out)

    def _method(self, rel: str, cls: str, name: str) -> ast.FunctionDef:
        for node in ast.walk(self._ast(rel)):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == name:
                        return item
        raise AscendTreeError(f"{self.package}/{rel}: no {cls}.{name}")

    def runner_assigns(self) -> frozenset[str]:
        """`self.<name> = ...` targets in any method of `NPUModelRunner` (worker/model_runner_v1.py;
        0.23.0 sets its proposer in `_set_up_drafter`)."""
        rel = "worker/model_runner_v1.py"
        cls = next((n for n in ast.walk(self._ast(rel)) if isinstance(n, ast.ClassDef) and n.name == "NPUModelRunner"),
                   None)
        if cls is None:
            raise AscendTreeError(f"{self.package}/{rel}: no NPUModelRunner")
        return frozenset().union(*(_self_attrs(f, ast.Store) for f in cls.body if isinstance(f, ast.FunctionDef)))

    def proposer_load_model_attrs(self) -> frozenset[str]:
        """`self.<name>` set or read in `AscendSpecDecodeBaseProposer.load_model`, the one every
        eagle / eagle3 / dflash proposer of this release inherits."""
        fn = self._method("spec_decode/llm_base_proposer.py", "AscendSpecDecodeBaseProposer", "load_model")
        return _self_attrs(fn, ast.Store) | _self_attrs(fn, ast.Load)

    def dflash_patch_reads(self) -> frozenset[str]:
        """`self._fused*` buffers read by its patched `precompute_and_store_context_kv`
        (patch/worker/patch_qwen3_dflash.py), the DFlash draft's per-step context K/V."""
        rel = "patch/worker/patch_qwen3_dflash.py"
        fn = next((n for n in ast.walk(self._ast(rel))
                   if isinstance(n, ast.FunctionDef) and n.name == "precompute_and_store_context_kv"), None)
        if fn is None:
            raise AscendTreeError(f"{self.package}/{rel}: no precompute_and_store_context_kv")
        return frozenset(a for a in _self_attrs(fn, ast.Load) if a.startswith("_fused"))


def _self_attrs(fn: ast.FunctionDef, ctx: type[ast.expr_context]) -> frozenset[str]:
    return frozenset(n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ctx)
                     and isinstance(n.value, ast.Name) and n.value.id == "self")
