"""Two engine replicas on a real local Ray Serve, behind the ingress, driven by the official openai client.

One module-scoped Ray for both tests: starting Ray and loading the weights in each replica is most of the cost.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from prefixkv.config import EngineConfig  # noqa: E402
from prefixkv.serve_ray import build_application  # noqa: E402
from prefixkv.serve_ray.replica import REPLICA_HEADER  # noqa: E402

PROMPT = "The capital of France is"
MODEL = None  # the served model: the one name a request may omit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url():
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = EngineConfig(dtype="float32", kv_cache_tokens=4096, max_model_len=512, num_threads=1)
        serve.run(build_application(config, replicas=2, policy="round-robin"), name="prefixkv", route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(client, max_tokens: int = 4):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text


def test_round_robin_uses_both_replicas(base_url):
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    assert client.models.list().data[0].id  # any endpoint passes through; round-robin counts this one too
    answers = [_complete(client) for _ in range(4)]
    assert len({replica for replica, _ in answers}) == 2
    assert len({text for _, text in answers}) == 1  # greedy: the same answer whichever replica served it
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == answers[0][1]
    with pytest.raises(openai.BadRequestError) as bad:  # the replica's own validation, passed through unchanged
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"


def test_replica_killed_under_load(base_url):
    """In-flight requests on the killed replica are retried on the other one by the ingress: every request
    succeeds; new requests succeed too; nothing hangs (the client's timeout is only a hang guard)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    results: list[object] = []

    def send():
        try:
            results.append(_complete(client, max_tokens=48))
        except Exception as exc:  # noqa: BLE001 - recorded, asserted on below
            results.append(exc)

    victim, _ = _complete(client)
    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # let the requests reach both replicas and start decoding
    ray.kill(ray.get_actor(f"SERVE_REPLICA::prefixkv#EngineReplica#{victim}", namespace="serve"))
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads)
    failures = [r for r in results if isinstance(r, Exception)]
    assert not failures, failures
    assert len(results) == 6
    for _ in range(3):
        _, text = _complete(client)
        assert text


def test_route_request_tokens_and_session_key():
    """The ingress routes on the prompt the replica will see (a chat after its template) and the session key."""
    from prefixkv.serve_ray.ingress import route_request, routing_tokenizer

    tokenizer = routing_tokenizer(None)
    body = b'{"prompt": "Hello there", "prompt_cache_key": "conv-1"}'
    route = route_request(body, {}, tokenizer)
    assert list(route.token_ids) == tokenizer.encode("Hello there") and route.session_key == "conv-1"
    messages = [{"role": "user", "content": "Hi"}]
    chat = route_request(b'{"messages": [{"role": "user", "content": "Hi"}]}', {"x-session-id": "s"}, tokenizer)
    assert list(chat.token_ids) == tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert chat.session_key == "s"
    assert route_request(b"not json", {}, tokenizer).token_ids == []  # the replica answers it with a 400
