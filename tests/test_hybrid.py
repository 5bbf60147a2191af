"""Hybrid (linear-attention / SSM) targets: lossless decoding with both rollback strategies.

Truth is the target's own plain greedy decoding (no cache, whole sequence each token), and,
for sampling, the exact joint distribution of its first tokens.
"""

import pytest
import torch
from test_sampling import CONFIGS, DEPTH, V, chi2_pvalue, empirical_joint, exact_joint
from tiny import HYBRID, check_stop_inside_run, plain_greedy_cached, random_prompt, taught_target, trained_draft

from dflash_robot.drafts.model import build_draft
from dflash_robot.errors import ConfigError, UnsupportedModelError
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig
from dflash_robot.targets.factory import make_target_adapter
from dflash_robot.targets.hf import HFTargetAdapter
from dflash_robot.targets.stateful import StatefulTargetAdapter

N = 40
CAPTURABLE = [f for f in HYBRID if f != "mamba2"]  # mamba2's SSM kernel cannot be stepped: replay only
CASES = [(f, r) for f in HYBRID for r in ("replay", "capture") if r == "replay" or f in CAPTURABLE]


def runtime(family, rollback, **kw):
    return DFlashRuntime.from_models(taught_target(family), trained_draft(family), rollback=rollback, **kw)


@pytest.mark.parametrize("family,rollback", CASES)
@pytest.mark.parametrize("block_size", [1, 4, 8, 16])
def test_greedy_equals_plain_greedy(family, rollback, block_size):
    # prompts of 20 tokens prefilled in chunks of 7: longer than one prefill chunk
    rt = runtime(family, rollback, prefill_chunk_size=7)
    assert rt.target.rollback_strategy == rollback
    for seed in (0, 1):
        prompt = random_prompt(20, seed)
        res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=block_size))
        assert res.token_ids == plain_greedy_cached(family, tuple(prompt), N)
        assert sum(res.acceptance_lengths) == N - 1


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_drafts_trained_against_hybrid_targets_get_accepted(family):
    """The training pipeline works on hybrid targets: multi-token acceptance happens."""
    rt = runtime(family, None)
    acc = []
    for seed in range(3):
        acc += rt.orchestrator.generate(random_prompt(20, seed),
                                        GenerationConfig(max_new_tokens=N, block_size=16)).acceptance_lengths
    assert max(acc) >= 3 and sum(acc) / len(acc) > 1.2


@pytest.mark.parametrize("rollback", ["replay", "capture"])
def test_stop_token_inside_accepted_run(rollback):
    check_stop_inside_run(runtime("qwen3_5", rollback), "qwen3_5", N)


def test_sequential_verify_with_capture():
    rt = runtime("qwen3_next", "capture")
    prompt = random_prompt(20, 3)
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=N, block_size=8,
                                                            verify_mode="sequential"))
    assert res.token_ids == plain_greedy_cached("qwen3_next", tuple(prompt), N)


class _CropOnly(StatefulTargetAdapter):
    """What a crop-based rollback does (z-lab's package on hybrids): conv history and KV are
    cropped, the recurrent state keeps the rejected tokens."""

    def _rollback_capture(self, removed, num_kept):
        from dflash_robot.targets.stateful import _crop_layer

        for i, layer in enumerate(self._cache.layers):
            _crop_layer(layer, removed, linear=i in self._linear_idx)
        self._len -= removed
        self._trim()


def test_negative_control_crop_only_rollback_diverges():
    """The equality tests can fail: leaving the rejected tokens in the recurrent state changes
    the output. A random-weight target (its argmax is not pinned by training) and a random
    draft, so that most of every block is rejected; the correct adapter matches, the crop-only
    one does not."""
    from tiny import make_config, plain_greedy
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(make_config("qwen3_5")).eval()
    draft = build_draft(model.config, 1, 16, mask_token_id=63).eval()
    good = DFlashRuntime.from_models(model, draft, rollback="capture")
    bad = DFlashRuntime.from_models(model, draft, rollback="capture")
    bad.orchestrator.target = _CropOnly(model, "capture")
    diverged = 0
    for seed in range(8):
        prompt = random_prompt(12, seed)
        truth = plain_greedy(model, prompt, 40)
        cfg = GenerationConfig(max_new_tokens=40, block_size=16)
        assert good.orchestrator.generate(prompt, cfg).token_ids == truth
        diverged += bad.orchestrator.generate(prompt, cfg).token_ids != truth
    assert diverged >= 3


def test_capture_memory_is_bounded_by_the_block():
    model = taught_target("qwen3_5")
    tgt = make_target_adapter(model, "capture")
    tgt.prefill(torch.tensor(random_prompt(10, 0)), None, 512)
    snap = tgt.snapshot()
    tgt.verify(torch.tensor(random_prompt(6, 1)), None)
    n_linear = sum(t == "linear_attention" for t in model.config.layer_types)
    assert len(tgt._captured) == n_linear and all(len(c) == 6 for c in tgt._captured)
    tgt.rollback(snap, 2)
    assert tgt._captured is None and tgt.seq_len == 12


# --- sampling -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hybrid_pair():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_value_heads=2,
        linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8, initializer_range=0.4,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = AutoModelForCausalLM.from_config(cfg).eval()
    draft = build_draft(cfg, 1, 4, mask_token_id=V - 1).eval()
    return target, draft


@pytest.mark.parametrize("rollback", ["replay", "capture"])
def test_sampling_is_lossless_on_a_hybrid_target(tiny_hybrid_pair, rollback):
    target, draft = tiny_hybrid_pair
    rt = DFlashRuntime.from_models(target, draft, rollback=rollback)
    counts = empirical_joint(rt, CONFIGS[0], 2000, block_size=4)
    assert counts.sum() == 2000 and counts.ndim == DEPTH
    assert chi2_pvalue(counts, exact_joint(target, CONFIGS[0])) > 1e-3


# --- refusals -------------------------------------------------------------------------------

def test_capture_refused_where_the_kernel_cannot_be_stepped():
    with pytest.raises(UnsupportedModelError, match="replay"):
        make_target_adapter(taught_target("mamba2"), "capture")
    assert make_target_adapter(taught_target("mamba2")).rollback_strategy == "replay"  # default falls back


def test_attention_adapter_refuses_stateful_targets():
    with pytest.raises(UnsupportedModelError, match="stateful"):
        HFTargetAdapter(taught_target("qwen3_5"))


def test_bad_rollback_name():
    with pytest.raises(ConfigError, match="rollback"):
        make_target_adapter(taught_target("qwen3_5"), "crop")
    with pytest.raises(ConfigError, match="rollback"):
        make_target_adapter(taught_target("llama"), "crop")


def test_unknown_cache_layer_refused(monkeypatch):
    import transformers.cache_utils as cu

    class StrangeLayer(cu.LinearAttentionLayer):
        pass

    real = cu.DynamicCache.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        self.layers[-1] = StrangeLayer()

    monkeypatch.setattr(cu.DynamicCache, "__init__", init)
    with pytest.raises(UnsupportedModelError, match="StrangeLayer"):
        make_target_adapter(taught_target("qwen3_5"))


def test_stateful_without_linear_layers_refused():
    model = taught_target("llama")

    class Flagged(type(model)):
        _is_stateful = True

    flagged = Flagged(model.config)
    with pytest.raises(UnsupportedModelError, match="no linear-attention layers"):
        make_target_adapter(flagged)


def test_stateful_targets_cannot_be_cropped_directly():
    tgt = make_target_adapter(taught_target("qwen3_5"), "replay")
    tgt.prefill(torch.tensor(random_prompt(5, 0)), None, 512)
    with pytest.raises(UnsupportedModelError):
        tgt.crop(2)
