"""`dflash-robot serve`: the OpenAI-compatible server on a tiny model, through the real
`openai` client (and raw HTTP for malformed requests). The truth every answer is compared
with is `DFlashRuntime.generate` on the same prompt and settings, run alone."""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from tiny import char_tokenizer, plain_greedy_cached, random_prompt, taught_target, trained_draft

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dflash_robot import DFlashRuntime  # noqa: E402
from dflash_robot.cli import main  # noqa: E402
from dflash_robot.serve import ServeSettings, create_app  # noqa: E402

MODEL = "tiny"
CHAT = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "abc def"}]


@pytest.fixture(scope="module")
def rt():
    return DFlashRuntime.from_models(taught_target("llama"), trained_draft("llama"), char_tokenizer())


class Gated:
    """An orchestrator wrapper for deterministic tests: a request's first step waits for
    `gate`; later steps wait for `resume` (both open by default); it records how many steps
    each request ran and when its step generator was closed."""

    def __init__(self, inner):
        self.inner = inner
        self.gate, self.resume = threading.Event(), threading.Event()
        self.gate.set()
        self.resume.set()
        self.entered, self.closed = threading.Event(), threading.Event()
        self.steps = 0

    def stream(self, ids, cfg, policy=None):
        self.entered.set()
        assert self.gate.wait(30)
        self.steps = 0
        gen = self.inner.stream(ids, cfg, policy)
        try:
            for ev in gen:
                self.steps += 1
                yield ev
                assert self.resume.wait(30)
        finally:
            gen.close()
            self.closed.set()


class Server:
    """uvicorn in a background thread on an ephemeral loopback port."""

    def __init__(self, app, **config):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    @property
    def engine(self):
        return self.app.state.engine


@contextmanager
def serving(runtime, **settings):
    server = Server(create_app(runtime, ServeSettings(model_name=MODEL, **settings)))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(rt):
    with serving(rt, max_body_bytes=4096) as s:
        yield s


def request(server, method, path, body=None, headers=None):
    """Raw HTTP -> (status, headers, decoded JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    payload = r.read().decode()
    conn.close()
    try:
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(payload)
    except ValueError:
        return r.status, {k.lower(): v for k, v in r.getheaders()}, payload


def assert_error(status, body, expected_status, param=None):
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


def expected_dflash(out):
    acc = out.acceptance_lengths
    return {"mean_acceptance_length": pytest.approx(out.mean_acceptance_length), "verify_steps": len(acc),
            "draft_tokens": sum(b - 1 for b in out.block_sizes), "accepted_tokens": sum(a - 1 for a in acc)}


def read_stream(stream):
    """-> (joined text, finish reason, the chunk with the finish reason, the usage chunk, chunks)."""
    chunks = list(stream)
    text, reason, last, usage = "", None, None, None
    for c in chunks:
        if not c.choices:
            usage = c
            continue
        ch = c.choices[0]
        piece = ch.delta.content if hasattr(ch, "delta") else ch.text
        text += piece or ""
        if ch.finish_reason:
            reason, last = ch.finish_reason, c
    return text, reason, last, usage, chunks


# --- answers equal the runtime's own, alone ---------------------------------------------------

def test_chat_non_streaming_equals_generate(server, rt):
    out = rt.generate(CHAT, max_new_tokens=40, block_size=8)
    resp = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40,
                                                   extra_body={"block_size": 8})
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == out.text and out.text
    assert resp.choices[0].finish_reason == out.finish_reason
    assert resp.usage.prompt_tokens == out.prompt_tokens == len(rt.encode(CHAT))
    assert resp.usage.completion_tokens == out.completion_tokens
    assert resp.usage.total_tokens == out.prompt_tokens + out.completion_tokens
    assert resp.model_extra["dflash"] == expected_dflash(out)
    # and the independent truth: the target's own greedy decoding, cut at EOS
    truth = plain_greedy_cached("llama", tuple(rt.encode(CHAT)), 40)
    eos = rt.tokenizer.eos_token_id
    cut = truth.index(eos) + 1 if eos in truth else len(truth)
    assert resp.choices[0].message.content == rt.tokenizer.decode(truth[:cut], skip_special_tokens=True)


def test_chat_streaming_equals_generate(server, rt):
    out = rt.generate(CHAT, max_new_tokens=50, block_size=16)
    stream = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=50,
                                                     stream=True, stream_options={"include_usage": True})
    text, reason, last, usage, chunks = read_stream(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert text == out.text and reason == out.finish_reason
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # it did stream
    assert last.model_extra["dflash"] == expected_dflash(out)
    assert usage is chunks[-1] and usage.choices == []
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (out.prompt_tokens, out.completion_tokens)
    assert usage.model_extra["dflash"] == expected_dflash(out)


def test_completions_raw_text_with_stop_strings(server, rt):
    prompt = "abc def"
    free = rt.generate(prompt, chat=False, max_new_tokens=40, block_size=8)
    assert len(free.text) > 12
    stop = free.text[8:10]  # a stop string met mid-output
    out = rt.generate(prompt, chat=False, max_new_tokens=40, block_size=8, stop=[stop, "never-there"])
    assert out.finish_reason == "stop" and len(out.text) < len(free.text)
    c = server.client()
    resp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, stop=[stop, "never-there"],
                                extra_body={"block_size": 8})
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.choices[0].text == out.text and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == out.completion_tokens
    stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, stop=stop, stream=True,
                                  extra_body={"block_size": 8})
    text, reason, last, usage, _ = read_stream(stream)
    assert (text, reason, usage) == (out.text, "stop", None)
    assert last.model_extra["dflash"] == expected_dflash(out)
    # token ids as the prompt
    ids = rt.encode(prompt, chat=False)
    resp = c.completions.create(model=MODEL, prompt=ids, max_tokens=40, extra_body={"block_size": 8})
    assert resp.choices[0].text == free.text


def test_sampling_with_seed_and_block_size_one(server, rt):
    c = server.client()
    out = rt.generate(CHAT, max_new_tokens=30, temperature=0.9, top_p=0.95, top_k=20, seed=7, block_size=4)
    resp = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0.9, top_p=0.95,
                                     seed=7, extra_body={"top_k": 20, "block_size": 4})
    assert resp.choices[0].message.content == out.text
    assert resp.model_extra["dflash"] == expected_dflash(out)
    resp = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, extra_body={"block_size": 1})
    assert resp.choices[0].message.content == rt.generate(CHAT, max_new_tokens=30).text
    d = resp.model_extra["dflash"]
    assert d["draft_tokens"] == d["accepted_tokens"] == 0 and d["mean_acceptance_length"] == 1.0
    assert d["verify_steps"] == resp.usage.completion_tokens - 1


def test_concurrent_streams_are_not_mixed(rt):
    prompts = ["abc def", "0123", "qrs tuv", random_prompt(20, 3)]  # four different answers
    solo = [rt.generate(p, chat=False, max_new_tokens=40, block_size=8) for p in prompts]
    assert len({o.text for o in solo}) == 4
    gated = Gated(rt.orchestrator)
    gated.gate.clear()  # hold the first request until all four are in the server
    with serving(dataclasses.replace(rt, orchestrator=gated)) as server:
        def one(prompt):
            stream = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=40, stream=True,
                                                        extra_body={"block_size": 8})
            return read_stream(stream)

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one, p) for p in prompts]
            deadline = time.monotonic() + 30
            while server.engine.pending < 3:
                assert time.monotonic() < deadline, "the requests did not all arrive"
                time.sleep(0.01)
            gated.gate.set()
            results = [f.result(timeout=60) for f in futures]
    for (text, reason, last, _, _), o in zip(results, solo, strict=True):
        assert text == o.text and reason == o.finish_reason
        assert last.model_extra["dflash"] == expected_dflash(o)


def wait_for(condition, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_disconnect_frees_the_engine_at_the_next_step(rt):
    prompt = [{"role": "user", "content": "hello world"}]
    out = rt.generate(prompt, max_new_tokens=30, block_size=8)  # (the server's worker shares rt's target)
    gated = Gated(rt.orchestrator)
    with serving(dataclasses.replace(rt, orchestrator=gated)) as server:
        def cancelled() -> float:
            return scrape(server).get(("dflash_requests_cancelled_total", ()), 0)

        # streaming: the client reads one chunk and goes away while the request is held after its first step
        client = server.client()
        gated.resume.clear()
        stream = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=200, stream=True,
                                                extra_body={"block_size": 1})
        next(iter(stream))
        stream.close()
        client.close()
        wait_for(lambda: cancelled() == 1, "the server to notice the disconnect")
        gated.resume.set()
        assert gated.closed.wait(20)
        assert gated.steps == 2  # the step in flight, then the generator was closed (200 steps otherwise)

        # non-streaming: the client sends its request and closes the connection without reading
        gated.closed.clear()
        gated.entered.clear()
        gated.resume.clear()
        body = json.dumps({"model": MODEL, "messages": prompt, "max_tokens": 200, "block_size": 1}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert gated.entered.wait(20)
        wait_for(lambda: cancelled() == 2, "the server to notice the disconnect")
        gated.resume.set()
        assert gated.closed.wait(20)
        assert gated.steps <= 2  # the disconnect may come before the first step ends
        wait_for(lambda: ("dflash_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "499")))
                 in scrape(server), "the cancelled request to be answered")

        # the engine is free: the next request runs, with the right answer
        resp = server.client().chat.completions.create(model=MODEL, messages=prompt, max_tokens=30,
                                                       extra_body={"block_size": 8})
        assert resp.choices[0].message.content == out.text


def test_full_queue_answers_429_with_retry_after(rt):
    expected = rt.generate(CHAT, max_new_tokens=20).text  # (the server's worker shares rt's target)
    gated = Gated(rt.orchestrator)
    gated.gate.clear()
    with serving(dataclasses.replace(rt, orchestrator=gated), max_queue=1, retry_after_s=2) as server:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 20}
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(request, server, "POST", "/v1/chat/completions", body)
            assert gated.entered.wait(20)  # the first request is running (held at its first step)
            waiting = pool.submit(request, server, "POST", "/v1/chat/completions", body)
            deadline = time.monotonic() + 20
            while server.engine.pending < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            status, headers, err = request(server, "POST", "/v1/chat/completions", body)
            assert_error(status, err, 429)
            assert headers["retry-after"] == "2"
            with pytest.raises(openai.RateLimitError):
                server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
            gated.gate.set()
            for f in (running, waiting):
                status, _, resp = f.result(timeout=60)
                assert status == 200 and resp["choices"][0]["message"]["content"] == expected
        metrics = scrape(server)
        assert metrics[("dflash_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "429")))] == 2


# --- bad requests: 4xx in OpenAI's error shape ------------------------------------------------

LONG = "a" * 1000  # 1000 characters = 1000 tokens: with 100 new tokens, over the tiny target's 1024


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"\xff\xfe", 400, None),
    ("/v1/chat/completions", [1, 2], 400, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": CHAT}, 400, "model"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 100}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 100,
                              "stream": True}, 400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 999]}, 400, None),  # out of the vocabulary
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": -1}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "block_size": 0}, 400, "block_size"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "block_size": 17}, 400, "block_size"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "min_p": 0.1}, 400, "min_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "guided_json": {}}, 400, "guided_json"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2**63]}, 400, "prompt"),  # past int64: not a 500
    ("/v1/completions", {"model": MODEL, "prompt": [-1, 2]}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "messages.0.content"),
])
def test_bad_requests_get_4xx_in_openai_shape(server, path, body, status, param):
    got, _, err = request(server, "POST", path, body)
    assert_error(got, err, status, param)


def test_bad_requests_through_the_client_and_the_server_survives(server, rt):
    c = server.client()
    with pytest.raises(openai.BadRequestError, match="request too long"):
        c.completions.create(model=MODEL, prompt=LONG, max_tokens=100)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=CHAT, n=3)
    resp = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10)
    assert resp.choices[0].message.content == rt.generate(CHAT, max_new_tokens=10).text


def test_off_values_of_extension_fields_are_accepted(server, rt):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "repetition_penalty": 1.0, "min_p": 0,
            "ignore_eos": False, "stop_token_ids": []}
    status, _, data = request(server, "POST", "/v1/completions", body)
    assert status == 200 and data["choices"][0]["text"] == rt.generate("hi", chat=False, max_new_tokens=4).text


def test_deeply_nested_body_is_a_400(server):
    status, _, err = request(server, "POST", "/v1/completions", b"[" * 4000)  # under the 4096-byte limit
    assert_error(status, err, 400)


def test_oversized_body_413_and_unknown_route_404(server):
    big = {"model": MODEL, "prompt": "a" * 5000}  # the module server allows 4096 bytes
    status, _, err = request(server, "POST", "/v1/completions", big)
    assert_error(status, err, 413)
    status, _, err = request(server, "GET", "/v1/nothing-here")
    assert_error(status, err, 404)
    status, _, err = request(server, "GET", "/v1/completions")
    assert_error(status, err, 405)


def test_api_key(rt):
    with serving(rt, api_key="s3cret") as server:
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
        for headers in ({}, {"Authorization": "s3cret"}, {"Authorization": "Bearer s3cre"}):
            status, h, err = request(server, "POST", "/v1/chat/completions",
                                     {"model": MODEL, "messages": CHAT}, headers)
            assert_error(status, err, 401)
        status, _, err = request(server, "GET", "/v1/models")
        assert_error(status, err, 401)
        resp = server.client("s3cret").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
        assert resp.choices[0].message.content == rt.generate(CHAT, max_new_tokens=5).text
        assert [m.id for m in server.client("s3cret").models.list()] == [MODEL]
        assert request(server, "GET", "/health")[0] == 200  # not a /v1 endpoint


# --- metrics, models, health ---------------------------------------------------------------------

def scrape(server) -> dict:
    status, headers, text = request(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_count_what_the_answer_reports(server, rt):
    before = scrape(server)
    resp = server.client().completions.create(model=MODEL, prompt=random_prompt(20, 5), max_tokens=40,
                                              extra_body={"block_size": 8})
    after = scrape(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    d = resp.model_extra["dflash"]
    assert delta("dflash_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("dflash_prompt_tokens_total") == resp.usage.prompt_tokens
    assert delta("dflash_generated_tokens_total") == resp.usage.completion_tokens
    assert delta("dflash_verify_steps_total") == d["verify_steps"] > 0
    assert delta("dflash_draft_tokens_total") == d["draft_tokens"] <= 7 * d["verify_steps"]
    assert d["mean_acceptance_length"] > 1  # the draft does accelerate on its own language
    assert delta("dflash_accepted_tokens_total") == d["accepted_tokens"]
    assert resp.usage.completion_tokens == 1 + d["verify_steps"] + d["accepted_tokens"]
    assert delta("dflash_acceptance_length_count") == d["verify_steps"]
    assert delta("dflash_acceptance_length_sum") == pytest.approx(d["mean_acceptance_length"] * d["verify_steps"])
    assert delta("dflash_time_to_first_token_seconds_count") == 1
    assert delta("dflash_inter_token_latency_seconds_count") == resp.usage.completion_tokens - 1
    assert after[("dflash_queue_depth", ())] == 0
    assert status_ok(server)


def status_ok(server) -> bool:
    status, _, body = request(server, "GET", "/health")
    models = request(server, "GET", "/v1/models")[2]
    return status == 200 and body["status"] == "ok" and [m["id"] for m in models["data"]] == [MODEL]


# --- shutdown ------------------------------------------------------------------------------------

def test_graceful_shutdown_finishes_the_running_stream(rt):
    expected = rt.generate(CHAT, max_new_tokens=30).text
    gated = Gated(rt.orchestrator)
    gated.gate.clear()
    server = Server(create_app(dataclasses.replace(rt, orchestrator=gated), ServeSettings(model_name=MODEL)))
    with ThreadPoolExecutor(1) as pool:
        def one():
            stream = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30,
                                                             stream=True)
            return read_stream(stream)

        fut = pool.submit(one)
        assert gated.entered.wait(20)
        server.server.should_exit = True  # what SIGTERM does
        time.sleep(0.3)
        gated.gate.set()
        text, reason, _, _, chunks = fut.result(timeout=60)
    server.thread.join(30)
    assert not server.thread.is_alive()
    assert text == expected and reason


def test_engine_stop_refuses_waiting_requests(rt):
    """Past the graceful timeout, shutdown drops waiting requests (503) and stops the running one."""
    gated = Gated(rt.orchestrator)
    gated.gate.clear()
    with serving(dataclasses.replace(rt, orchestrator=gated)) as server:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 20}
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(request, server, "POST", "/v1/chat/completions", body)
            assert gated.entered.wait(20)
            second = pool.submit(request, server, "POST", "/v1/chat/completions", body)
            while server.engine.pending < 1:
                time.sleep(0.01)
            stopper = threading.Thread(target=server.engine.stop)
            stopper.start()
            status, headers, err = second.result(timeout=30)
            assert_error(status, err, 503)
            assert "retry-after" in headers
            gated.gate.set()
            stopper.join(30)
            status, _, err = first.result(timeout=30)
            assert_error(status, err, 503)


# --- the command line --------------------------------------------------------------------------

def test_serve_help_does_not_import_torch():
    code = ("import sys\nfrom dflash_robot.cli import main\ntry:\n    main(['serve', '--help'])\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules and 'fastapi' not in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "--max-queue" in res.stdout and "--api-key" in res.stdout


@pytest.mark.parametrize("extra,match", [
    (["--adaptive", "--block-size", "4"], "--adaptive"), (["--block-size", "99"], "out of range"),
    (["--port", "70000"], "--port"), (["--draft", "/no/such/draft"], "does not exist"),
    (["--api-key", " "], "--api-key"),
])
def test_serve_validates_before_loading(capsys, extra, match):
    assert main(["serve", *extra]) == 2
    assert match in capsys.readouterr().err


def test_serve_refuses_a_taken_port_or_bad_host_before_loading(capsys, monkeypatch):
    import socket

    from dflash_robot.cli import serve as serve_cli

    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(serve_cli, "load_runtime", loaded)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve", "--host", "10.0.0.999"]) == 2
    assert "cannot listen on 10.0.0.999:8000" in capsys.readouterr().err


def test_serve_address_check_takes_ipv6(monkeypatch):
    """The pre-load address check binds the way uvicorn will, IPv6 included."""
    import argparse
    import socket

    from dflash_robot.cli import serve as serve_cli

    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            pass
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    args = argparse.Namespace(api_key=None, port=0, host="::1", model_name=None, target=None, draft=None,
                              engine="auto", adaptive=False, block_size=None)
    serve_cli._validate(args)  # no "cannot listen" for an IPv6 host
