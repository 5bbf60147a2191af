"""Tiny models the tests build themselves: targets of several families, taught a simple
language so that greedy outputs are predictable, and drafts trained a little against them."""

from __future__ import annotations

import functools

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflash_robot.drafts.model import DFlashDraft, build_draft
from dflash_robot.training.trainer import DraftTrainer, OptimConfig

VOCAB = 64
MASK = VOCAB - 1
SLIDING_WINDOW = 8  # Gemma 3 tests use prompts longer than this

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def make_config(family: str):
    if family in HYBRID_SPECS:
        from transformers import AutoConfig

        model_type, extra = HYBRID_SPECS[family]
        return AutoConfig.for_model(model_type, **{**_COMMON, **extra})
    if family == "llama":
        return LlamaConfig(**_COMMON)
    if family == "mistral":
        return MistralConfig(**_COMMON, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**_COMMON)
    if family == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=8)
    if family == "gemma3":
        return Gemma3TextConfig(**_COMMON, head_dim=8, sliding_window=SLIDING_WINDOW,
                                layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                final_logit_softcapping=None, attn_logit_softcapping=None)
    raise ValueError(family)


_MODELS = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen3": Qwen3ForCausalLM,
           "qwen2": Qwen2ForCausalLM, "gemma3": Gemma3ForCausalLM}

# Hybrid (stateful) families: linear-attention / SSM layers mixed with attention layers.
_LINEAR = dict(head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "linear_attention", "full_attention"] * 2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
HYBRID_SPECS = {
    "qwen3_5": ("qwen3_5_text", _LINEAR),
    "qwen3_next": ("qwen3_next", {**_LINEAR, **_MOE}),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**_LINEAR, **_MOE}),
    "lfm2": ("lfm2", dict(layer_types=["conv", "conv", "full_attention"] * 2, block_ff_dim=64,
                          block_auto_adjust_ff_dim=False, conv_L_cache=3)),
    "mamba2": ("mamba2", dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, expand=2, chunk_size=8,
                              conv_kernel=4)),
}
HYBRID = tuple(HYBRID_SPECS)


def language(n: int, length: int, seed: int) -> torch.Tensor:
    """Sequences that mostly follow a fixed random successor table, with some noise."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randperm(VOCAB - 1, generator=torch.Generator().manual_seed(1234))
    x = torch.empty(n, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB - 1, (n,), generator=g)
    for t in range(1, length):
        nxt = succ[x[:, t - 1]]
        noise = torch.rand(n, generator=g) < 0.15
        x[:, t] = torch.where(noise, torch.randint(0, VOCAB - 1, (n,), generator=g), nxt)
    return x


@functools.cache
def taught_target(family: str, seed: int = 0):
    """A tiny target of `family`, trained for a few seconds on `language`. Eval mode, fp32."""
    torch.manual_seed(seed)
    if family in HYBRID_SPECS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(make_config(family))
    else:
        model = _MODELS[family](make_config(family))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = language(256, 24, seed)
    for step in range(60):
        batch = data[(step * 16) % 256:(step * 16) % 256 + 16]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


@torch.no_grad()
def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decoding, recomputing the whole sequence each token (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def random_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 1, (length,), generator=g).tolist()


@functools.cache
def trained_draft(family: str, block_size: int = 16, steps: int = 120, num_layers: int = 2) -> DFlashDraft:
    """A draft trained a little on the target's own greedy continuations."""
    model = taught_target(family)
    seqs = []
    for i in range(24):
        prompt = random_prompt(6, 100 + i)
        if family in HYBRID_SPECS:  # cached greedy: the no-cache loop is slow on linear-attention kernels
            with torch.no_grad():
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0]
        else:
            ids = torch.tensor(prompt + plain_greedy_cached(family, tuple(prompt), 40))
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[len(prompt):] = True
        seqs.append((ids, mask))
    torch.manual_seed(0)
    draft = build_draft(model.config, num_layers, block_size, mask_token_id=MASK)
    trainer = DraftTrainer(model, draft, OptimConfig(lr=3e-3, warmup_steps=10, total_steps=steps,
                                                     blocks_per_seq=16), cache_features=True)
    for s in range(steps):
        first = (s * 4) % 24
        trainer.train_step(seqs[first:first + 4], keys=list(range(first, first + 4)))
    return draft.eval().requires_grad_(False)


@functools.cache
def plain_greedy_cached(family: str, prompt: tuple[int, ...], n: int) -> list[int]:
    return plain_greedy(taught_target(family), list(prompt), n)


def find_stop_inside_run(rt, n: int, block_size: int = 16):
    """A (prompt, stop token, tokens generated without stops) such that the stop token is the
    middle token of a step that committed >= 3 tokens and occurs nowhere before it; so a run
    with that stop token must cut inside an accepted run. Fails the test if none is found."""
    import pytest

    from dflash_robot.runtime.config import GenerationConfig

    for seed in range(10):
        prompt = random_prompt(20, seed)
        steps = list(rt.orchestrator.stream(prompt, GenerationConfig(max_new_tokens=n, block_size=block_size)))
        seen = [t for ev in steps for t in ev.tokens]
        for i, ev in enumerate(steps):
            before = [t for e in steps[:i] for t in e.tokens]
            if len(ev.tokens) >= 3 and ev.tokens[1] not in before + ev.tokens[:1]:
                return prompt, ev.tokens[1], seen
    pytest.fail("no accepted run of >= 3 tokens found to place a stop token in")


def check_stop_inside_run(rt, family: str, n: int) -> None:
    """A stop token met inside an accepted run cuts the output right after it, equal to the
    target's own greedy decoding up to there; the runtime is reusable afterwards."""
    from dflash_robot.runtime.config import GenerationConfig

    prompt, stop, seen = find_stop_inside_run(rt, n)
    cut = seen.index(stop) + 1
    res = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=n, block_size=16, stop_token_ids=(stop,)))
    assert res.token_ids == seen[:cut] == plain_greedy_cached(family, tuple(prompt), n)[:cut]
    assert res.finish_reason == "stop"
    assert res.acceptance_lengths[-1] == 2  # cut inside the run: 1 accepted + the stop
    again = rt.orchestrator.generate(prompt, GenerationConfig(max_new_tokens=n, block_size=16))
    assert again.token_ids == plain_greedy_cached(family, tuple(prompt), n)


CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;()[]=+-*/_'\"\n#<>?!%"[:VOCAB - 2]


def char_tokenizer():
    """A character-level tokenizer over VOCAB - 2 characters, "[UNK]" (also EOS) and the
    mask token, with a small chat template; it lets tiny models run text commands."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["[UNK]"] = VOCAB - 2
    vocab["[MASK]"] = MASK
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[UNK]",
                                   mask_token="[MASK]")
    fast.chat_template = ("{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}a: {% endif %}")
    return fast
