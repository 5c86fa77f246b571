"""SGLang rollout capture against SGLang's own source (0.5.12 and 0.5.23, read with `ast`, no GPU).

What `verl_speco.engines.sglang_capture` sends and expects is checked against the two source trees
scripts/setup_env.sh installs off sys.path: every server flag a plan writes is a `ServerArgs` field
of the release it is planned for (and 0.5.12, which lacks the aux flags, is refused aux capture),
the per-request field is a `GenerateReqInput` field that admits a bool, the aux ids map to what
SGLang's capture hook captures, and the response layout is parsed as SGLang builds it.
"""

from __future__ import annotations

import ast
import re

import pytest
import torch

from drafters.common.layer_ids import to_engine_layer_ids
from drafters.common.target import TargetSpec
from drafters.registry import get_family
from feature_store import Layout
from verl_speco.engines.sglang_capture import (
    AUX_RELEASES,
    PLAIN_RELEASES,
    SGLANG_LAYER_KEY,
    RolloutCaptureRefused,
    hidden_rows,
    plan_rollout_capture,
)
from verl_speco.online.config import DrafterConfigError, DrafterRunConfig
from verl_speco.online.rollout_capture import choose_capture_source

from .test_sglang_source import TREES, _class, _module, sglang_facts

L = 8
SPEC = TargetSpec.from_hf_config({"hidden_size": 64, "num_hidden_layers": L, "vocab_size": 96, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128,
                                  "rms_norm_eps": 1e-6, "model_type": "qwen3", "max_position_embeddings": 512})
EAGLE1 = ("eagle1", Layout(layer_ids=(), last_hidden="post_norm"), ("input_ids", "loss_mask", "last_hidden"))
DFLASH = ("dflash", Layout(layer_ids=(2, 3, 4, 5, 6), last_hidden="post_norm"), ("input_ids", "loss_mask", "aux_hidden"))
EAGLE3 = ("eagle3", Layout(layer_ids=(2, 4, 5), last_hidden="post_norm"),
          ("input_ids", "loss_mask", "aux_hidden", "last_hidden"))


def generate_req_fields(release: str) -> dict[str, str]:
    """`GenerateReqInput` field -> its annotation's source text, in `release`'s io_struct.py, with
    0.5.23's alias `ReturnHiddenStatesMode` (managers/schedule_batch.py) spelled out."""
    tree = _module(TREES[release], "srt/managers/io_struct.py")
    cls = _class(tree, "GenerateReqInput")
    batch = _module(TREES[release], "srt/managers/schedule_batch.py")
    aliases = {t.id: ast.unparse(n.value) for n in batch.body if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Name) and t.id == "ReturnHiddenStatesMode"}
    out = {}
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            text = ast.unparse(n.annotation)
            for name, value in aliases.items():
                text = re.sub(rf"\b{name}\b", value, text)
            out[n.target.id] = text
    return out


@pytest.mark.parametrize("release", list(TREES))
def test_plans_write_only_flags_and_fields_the_release_has(release: str) -> None:
    facts = sglang_facts(TREES[release])
    plain = plan_rollout_capture(*EAGLE1, L, release, serves_draft=True)
    assert plain.server_args() == {"enable_return_hidden_states": True}
    assert set(plain.server_args()) <= facts["fields"]
    annotation = generate_req_fields(release)["return_hidden_states"]
    assert re.search(r"\bbool\b", annotation), annotation  # 0.5.12 Union[List[bool], bool]; 0.5.23 also "last"
    if release == "0.5.23":  # True asks for every row (FULL), "last" for the last one only
        assert "Literal['last']" in annotation
        source = ast.unparse(_module(TREES[release], "srt/managers/schedule_batch.py"))
        assert "if return_hidden_states is True:\n        return CaptureHiddenMode.FULL" in source
    assert set(plain.request_fields()) <= set(generate_req_fields(release))
    aux_flags = {"enable_return_aux_hidden_states", "return_aux_hidden_state_layer_ids", "speculative_algorithm"}
    if release in AUX_RELEASES:
        aux = plan_rollout_capture(*DFLASH, L, release, serves_draft=False)
        assert set(aux.server_args()) <= facts["fields"] and aux.convention in facts["algorithms"]
        assert aux.cli_flags() == ["--enable-return-aux-hidden-states", "--speculative-algorithm", "DFLASH",
                                   "--return-aux-hidden-state-layer-ids", "1", "2", "3", "4", "5"]
    else:  # what the release lacks is refused by name, never sent
        assert not aux_flags <= facts["fields"]
        with pytest.raises(RolloutCaptureRefused, match=rf"SGLang {re.escape(release)}.*enable-return-aux"):
            plan_rollout_capture(*DFLASH, L, release, serves_draft=False)
    assert set(PLAIN_RELEASES) == set(TREES)


def test_aux_ids_name_the_layers_sglangs_hook_captures() -> None:
    """SGLang 0.5.23 `set_dflash_layers_to_capture` / `set_eagle3_layers_to_capture` (explicit ids)
    capture before layer `val + 1`: HF hidden_states[val + 1] = our internal id."""
    tree = _module(TREES["0.5.23"], "srt/models/qwen3.py")
    source = ast.unparse(_class(tree, "Qwen3ForCausalLM"))
    assert source.count("self.model.layers_to_capture = [val + 1 for val in layer_ids]") == 2
    plan = plan_rollout_capture(*DFLASH, L, "0.5.23", serves_draft=False)
    assert tuple(v + 1 for v in plan.sglang_layer_ids) == plan.layout.layer_ids == (2, 3, 4, 5, 6)
    assert to_engine_layer_ids((2, 4, 5), SGLANG_LAYER_KEY, L) == (1, 3, 4)
    assert plan.layout.last_hidden == "none" and plan.field() == "aux_hidden" and plan.width(64) == 5 * 64
    with pytest.raises(RolloutCaptureRefused, match="within 1..7"):  # L (post-norm) is never captured
        plan_rollout_capture("dflash", Layout(layer_ids=(2, 8)), DFLASH[2], L, "0.5.23", serves_draft=False)


def test_families_the_rollout_cannot_serve_are_refused_with_the_reason() -> None:
    for args, release, draft, want in [
            (EAGLE3, "0.5.23", False, "never both"), (DFLASH, "0.5.23", True, "loads no draft"),
            (EAGLE1, "0.6.0", False, "checked on SGLang"),
            (("medusa", DFLASH[1], DFLASH[2]), "0.5.23", False, "no SGLang aux-capture convention")]:
        with pytest.raises(RolloutCaptureRefused, match=want):
            plan_rollout_capture(*args, L, release, serves_draft=draft)


def test_capture_source_forced_refuses_auto_falls_back_actor_is_default(caplog: pytest.LogCaptureFixture) -> None:
    family = get_family("eagle3")
    fcfg = family.config_cls()
    assert DrafterRunConfig().capture_source == "actor"
    assert choose_capture_source(DrafterRunConfig(), "sglang", family, fcfg, SPEC, "0.5.23") is None
    with pytest.raises(DrafterConfigError, match=r"drafter\.capture_source: got 'rollout', but .*never both"):
        choose_capture_source(DrafterRunConfig(capture_pass="old_logprob", capture_source="rollout"), "sglang", family, fcfg, SPEC, "0.5.23")
    with caplog.at_level("WARNING"):
        assert choose_capture_source(DrafterRunConfig(capture_pass="old_logprob", capture_source="auto"), "sglang", family, fcfg, SPEC,
                                     "0.5.23") is None
    assert "capturing from the actor" in caplog.text and "never both" in caplog.text
    with pytest.raises(DrafterConfigError, match="rollout.name=sglang, got 'vllm'"):
        choose_capture_source(DrafterRunConfig(capture_pass="old_logprob", capture_source="rollout"), "vllm", family, fcfg, SPEC, None)
    e1 = get_family("eagle1")
    plan = choose_capture_source(DrafterRunConfig(family="eagle1", capture_pass="old_logprob", capture_source="rollout"), "sglang", e1,
                                 e1.config_cls(), SPEC, "0.5.12")
    assert plan is not None and plan.mode == "plain" and plan.layout == Layout(layer_ids=(), last_hidden="post_norm")
    with pytest.raises(DrafterConfigError, match="capture_pass='post_update' needs the updated actor's forward"):
        choose_capture_source(DrafterRunConfig(family="eagle1", capture_source="rollout"), "sglang", e1,
                              e1.config_cls(), SPEC, "0.5.12")  # online: the rollout's rows are pre-update
    with pytest.raises(DrafterConfigError, match="capture_source: got 'both'"):
        DrafterRunConfig(capture_pass="old_logprob", capture_source="both").validate()


def _meta(prompt: int, decode: int, width: int = 4, chunks: int = 1) -> dict[str, object]:
    rows = torch.arange((prompt + decode) * width, dtype=torch.float32).reshape(-1, width)
    cut = [round(prompt * i / chunks) for i in range(chunks + 1)]
    prefill = [rows[a:b].tolist() for a, b in zip(cut, cut[1:])]
    return {"hidden_states": prefill + [r.tolist() for r in rows[prompt:]]}


def test_response_rows_are_aligned_or_dropped_by_reason() -> None:
    """P = 3, n = 4 -> [[3, D], [D], [D], [D]]: 6 rows; any other count is dropped, never realigned."""
    got = hidden_rows(_meta(3, 3), prompt_len=3, num_output=4, width=4)
    assert isinstance(got, torch.Tensor) and got.shape == (6, 4)
    assert torch.equal(got, torch.arange(24, dtype=torch.float32).reshape(6, 4))
    chunked = hidden_rows(_meta(5, 2, chunks=2), prompt_len=5, num_output=3, width=4)  # chunked prefill
    assert isinstance(chunked, torch.Tensor) and chunked.shape == (7, 4)
    assert hidden_rows(_meta(3, 2), 3, 4, 4) == "rollout_short_decode"  # sglang#26163 (spec decoding)
    assert hidden_rows(_meta(2, 3), 3, 4, 4) == "rollout_short_prefill"  # a radix-cache hit
    assert hidden_rows(_meta(3, 4), 3, 4, 4) == "rollout_bad_rows"  # more rows than positions
    assert hidden_rows(_meta(3, 3), 3, 4, 5) == "rollout_bad_rows"  # wrong width
    assert hidden_rows({}, 3, 4, 4) == "rollout_bad_rows"
    nan = _meta(3, 3)
    nan["hidden_states"][1][0] = float("nan")  # type: ignore[index]
    assert hidden_rows(nan, 3, 4, 4) == "rollout_bad_rows"
