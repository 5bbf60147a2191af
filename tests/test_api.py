"""The text-in/text-out API (`DFlashRuntime.generate` / `stream`) and `TextStream`."""

import pytest
import torch
from tiny import char_tokenizer, plain_greedy_cached, taught_target, trained_draft

import dflash_robot
from dflash_robot import DFlashRuntime
from dflash_robot.errors import ConfigError
from dflash_robot.runtime.text import TextStream


@pytest.fixture(scope="module")
def rt():
    return DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"), char_tokenizer())


def test_top_level_exports_are_lazy_and_complete():
    assert dflash_robot.DFlashRuntime is DFlashRuntime
    for name in dflash_robot.__all__:
        assert getattr(dflash_robot, name) is not None
    with pytest.raises(AttributeError):
        dflash_robot.NoSuchThing  # noqa: B018


def test_generate_text_equals_target_greedy(rt):
    ids = rt.encode("abc def")
    out = rt.generate("abc def", max_new_tokens=30, block_size=8)
    truth = plain_greedy_cached("llama", tuple(ids), 30)
    eos = rt.tokenizer.eos_token_id
    cut = truth.index(eos) + 1 if eos in truth else len(truth)  # EOS stops by default
    assert out.token_ids == truth[:cut]
    assert out.text == rt.tokenizer.decode(truth[:cut], skip_special_tokens=True)
    assert out.prompt_tokens == len(ids) and out.completion_tokens == len(out.token_ids)
    assert out.finish_reason == ("stop" if eos in truth[:30] else "length")
    assert sum(out.acceptance_lengths) == len(out.token_ids) - 1


def test_stream_deltas_join_to_generate_text(rt):
    for block in (1, 4, 16):
        deltas = list(rt.stream("hello world", max_new_tokens=40, block_size=block))
        assert "".join(deltas) == rt.generate("hello world", max_new_tokens=40, block_size=block).text


def test_messages_use_the_chat_template(rt):
    msgs = [{"role": "user", "content": "abc"}]
    assert rt.encode(msgs) == rt.encode("abc")
    assert rt.encode("abc", chat=False) == rt.tokenizer("abc")["input_ids"]
    with pytest.raises(ConfigError, match="messages"):
        rt.encode([{"content": "no role"}])


def test_stop_strings_cut_text_and_stop_the_engine(rt):
    full = rt.generate("abc", max_new_tokens=40, block_size=8)
    assert len(full.text) > 6
    stop = full.text[3:5]
    first = full.text.find(stop)
    out = rt.generate("abc", max_new_tokens=40, block_size=8, stop=[stop])
    assert out.text == full.text[:first] and out.finish_reason == "stop"
    assert len(out.token_ids) < len(full.token_ids)  # generation ended early
    assert "".join(rt.stream("abc", max_new_tokens=40, block_size=8, stop=[stop])) == full.text[:first]


def test_defaults_match_the_cli(rt):
    cfg = rt.config()
    assert cfg.max_new_tokens == 128 and rt.tokenizer.eos_token_id in cfg.stop_token_ids
    assert cfg.sampling.greedy
    with pytest.raises(ConfigError, match="top_p"):
        rt.generate("abc", top_p=0)


class ByteTokenizer:
    """ids are single bytes; decode replaces incomplete UTF-8 with U+FFFD, like BPE tokenizers."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _bytes(s):
    return list(s.encode("utf-8"))


def test_text_stream_holds_back_incomplete_utf8():
    ts = TextStream(ByteTokenizer())
    ids = _bytes("aé€b")
    deltas = [ts.push([i]) for i in ids] + [ts.finish()]
    assert "".join(deltas) == "aé€b"
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("chunks", [[1] * 20, [3] * 7, [20]])
def test_text_stream_stop_string_across_steps(chunks):
    text = "hello <|end|> after"
    ids = _bytes(text)
    ts = TextStream(ByteTokenizer(), stop=["<|end|>", "zzz"])
    out, k = [], 0
    for n in chunks:
        out.append(ts.push(ids[k:k + n]))
        k += n
        if ts.stopped:
            break
    out.append(ts.finish())
    assert "".join(out) == "hello " and ts.stopped and ts.text == "hello "
    assert not any("<" in d for d in out)  # a partial stop string is never emitted


def test_text_stream_releases_a_false_stop_prefix():
    ts = TextStream(ByteTokenizer(), stop=["<|end|>"])
    assert ts.push(_bytes("ab<|")) == "ab"
    assert ts.push(_bytes("x")) == "<|x"
    assert ts.finish() == "" and not ts.stopped


def test_events_give_token_level_steps(rt):
    cfg = rt.config(max_new_tokens=12, block_size=4)
    toks = [t for ev in rt.events("abc", cfg) for t in ev.tokens]
    assert toks == rt.generate("abc", max_new_tokens=12, block_size=4).token_ids
    assert torch.is_tensor(rt.target.input_embedding_weight())
