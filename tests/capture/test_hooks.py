"""Hook capture vs the reference computed another way: HF ``output_hidden_states=True``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from verl_speco.capture.hooks import FeatureCapture, capture_features, find_decoder_modules


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0          # right padding
    mask[2, :3] = 0          # left padding
    return ids, mask


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gpt2"])
def test_hooks_equal_output_hidden_states(tiny, arch: str) -> None:
    model = getattr(tiny, arch)()
    num_layers = model.config.num_hidden_layers
    layer_ids = tuple(sorted({0, 2, num_layers // 2, num_layers - 1, num_layers}))
    ids, mask = _inputs(model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        with capture_features(model, layer_ids, dtype=None, device=None) as cap:
            out = model(input_ids=ids, attention_mask=mask)
            feats = cap.pop()
    assert torch.equal(out.logits, ref.logits)
    assert len(ref.hidden_states) == num_layers + 1
    for i in layer_ids:
        assert torch.equal(feats.hidden[i], ref.hidden_states[i]), f"layer id {i}"
    assert torch.equal(feats.aux_hidden, torch.cat([ref.hidden_states[i] for i in layer_ids], -1))
    # last hidden == the final norm applied to the raw output of the last decoder layer
    mods = find_decoder_modules(model)
    raw_last: list[torch.Tensor] = []
    handle = mods.layers[-1].register_forward_hook(lambda _m, _a, o: raw_last.append(
        o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(feats.last_hidden, mods.final_norm(raw_last[0]))
    assert not torch.equal(feats.last_hidden, raw_last[0])      # the norm really did something


def test_dtype_device_and_no_grad_independent(tiny) -> None:
    model = tiny.qwen3()
    ids, mask = _inputs(model.config.vocab_size)
    with capture_features(model, (2, 4, 5)) as cap:     # grad enabled; default bf16 on CPU
        model(input_ids=ids, attention_mask=mask)
        feats = cap.pop()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert feats.aux_hidden.dtype == torch.bfloat16 and feats.aux_hidden.shape == (3, 11, 3 * 64)
    assert not feats.aux_hidden.requires_grad and feats.last_hidden.grad_fn is None
    assert torch.equal(feats.hidden[4], ref.hidden_states[4].to(torch.bfloat16))
    assert torch.equal(feats.last_hidden, ref.hidden_states[-1].to(torch.bfloat16))


def test_select_rows_and_pop_all(tiny) -> None:
    model = tiny.qwen3()
    ids, mask = _inputs(model.config.vocab_size)
    keep = mask.bool()
    with torch.no_grad(), FeatureCapture(model, (3,), dtype=None, select=lambda t: t[keep[: len(t)]]) as cap:
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids[:1], attention_mask=mask[:1])
        with pytest.raises(RuntimeError, match="exactly 1"):
            cap.pop()
        first, second = cap.pop_all()
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert torch.equal(first.hidden[3], ref.hidden_states[3][keep])        # [nnz, H]
    assert second.hidden[3].shape == (11, 64)


def test_no_hooks_or_references_left(tiny) -> None:
    model = tiny.qwen3()
    ids, mask = _inputs(model.config.vocab_size)
    cap = FeatureCapture(model, (0, 2, 8), dtype=None)
    with torch.no_grad(), cap:
        model(input_ids=ids, attention_mask=mask)
    feats = cap.pop()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "the capture object (or its features) keeps the model alive"
    assert feats.hidden[8].shape == (3, 11, 64)


def test_bad_layer_ids(tiny) -> None:
    model = tiny.qwen3()
    with pytest.raises(ValueError, match=r"outside \[0, 8\]"), capture_features(model, (2, 9)):
        pass
    with pytest.raises(ValueError, match="duplicates"):
        capture_features(model, (2, 2))
    with pytest.raises(ValueError, match="layers_path"):
        find_decoder_modules(model, layers_path="model.embed_tokens")
