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

PROMPT = "The capital of France is a city that many people visit every year, and its most famous sight is"
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
        serve.run(build_application(config, replicas=2, policy="precise"), name="prefixkv", route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(client, max_tokens: int = 4):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text


def test_precise_routing_follows_the_cache(base_url):
    """Ray Serve's request router runs prefixkv's precise policy: a repeated prompt goes back to the replica
    whose KV events say it holds the prompt's pages (and hits there); distinct prompts sent at once spread over
    both replicas; the answers are the same whichever replica computed them."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    assert client.models.list().data[0].id  # any endpoint passes through
    first, text = _complete(client)
    for _ in range(2):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        answer = raw.parse()
        assert raw.headers[REPLICA_HEADER] == first and answer.choices[0].text == text
        assert answer.usage.prompt_tokens_details.cached_tokens > 0
    replicas: list[str] = []

    def send(i: int) -> None:
        prompt = f"Request {i}: " + " ".join(f"word{i}x{j}" for j in range(40))
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        replicas.append(raw.headers[REPLICA_HEADER])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(replicas) == 6 and len(set(replicas)) == 2
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text
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


def test_route_request_keys_tenants_apart(tmp_path):
    """With tenant isolation the router keys a prompt with the salt the replica will give it: two tenants'
    equal prompts never share block hashes; two keys of one tenant do."""
    from prefixkv.serve_ray.ingress import TenantSalts, route_request
    from prefixkv.server.auth import Principal, derive_cache_salt

    keys = tmp_path / "keys"
    keys.write_text("k1 acme\nk2 acme\nk3 beta\n")
    salts = TenantSalts({"api_key_file": str(keys)})
    body = b'{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]}'
    routes = [
        route_request(body, {"authorization": f"Bearer {k}"}, tokenizer=object(), salts=salts)
        for k in ("k1", "k2", "k3")
    ]
    assert routes[0].cache_salt == derive_cache_salt("api-key", Principal("acme", "user"), "k1", None, None)
    assert routes[0].block_hashes(16) == routes[1].block_hashes(16) != routes[2].block_hashes(16)
    assert route_request(body, {}, tokenizer=object(), salts=TenantSalts({})).cache_salt is None
