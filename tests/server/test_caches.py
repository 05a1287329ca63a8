"""/v1/caches against the real app: entries created, used (through the official `openai` and `anthropic` SDKs with
`cached_content`), listed, extended and deleted; deleting releases the retention at once; tenant isolation on every
route (another tenant's name is the API's own 404 or 400 and takes nothing from its owner); the 400s of the body;
and `prefixkv cache ...` against the server. One server for the module, on the suite's shared weights; few short
requests."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta

import anthropic
import httpx
import openai
import pytest

from prefixkv.server.cache_store import PAGE_TOKENS_HEADER
from tests.server.live_server import running_server

KEY_FILE = "alice-key alice\nbob-key bob\ncarol-key carol\nops-key ops admin\n"
PAGE = 16  # the hash cache's default page size
RETAINED_PAGES = 25  # 10% of a 4,096-token pool


def headers(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def served(new_engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEY_FILE)
    engine = new_engine(kv_cache_tokens=4096, retained_pool_fraction=0.1)
    with running_server(engine, api_key_file=str(path)) as (base, engine, app):
        yield base, engine.model_name, app.state.server


def api(served, method: str, path: str, key: str = "alice-key", **kw) -> httpx.Response:
    return httpx.request(method, served[0] + path, headers=headers(key), timeout=60, **kw)


def create(served, key: str = "alice-key", **body) -> dict:
    r = api(served, "POST", "/v1/caches", key, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def chat_entry(served, key: str = "alice-key", **kw) -> dict:
    tag = uuid.uuid4().hex[:8]
    system = f"[{tag}] You are terse. " + " ".join(f"Rule {i}." for i in range(20))
    return create(served, key, messages=[{"role": "system", "content": system}], **kw)


def openai_client(served, key: str = "alice-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=key, max_retries=0)


def retained_pages(served) -> int:
    return api(served, "GET", "/cache/summary", "ops-key").json()["retained_pages"]


def test_an_entry_created_used_extended_and_deleted(served):
    entry = chat_entry(served, ttl="300s", display_name="rules")
    total = entry["usage"]["total_tokens"]
    assert entry["id"].startswith("cache_") and entry["name"] == "caches/" + entry["id"]
    assert entry["object"] == "cache" and entry["kind"] == "messages" and entry["display_name"] == "rules"
    assert entry["model"] == served[1] and "tenant" not in entry
    assert entry["usage"]["cached_tokens"] == total // PAGE * PAGE > 0
    expire = datetime.fromisoformat(entry["expire_time"])
    assert abs((expire - datetime.now(UTC)).total_seconds() - 300) < 30

    reply = openai_client(served).chat.completions.create(
        model=served[1],
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"cached_content": entry["name"]},
    )
    assert reply.usage.prompt_tokens > total  # the entry's messages, then the request's
    assert reply.usage.prompt_tokens_details.cached_tokens >= total // PAGE * PAGE

    assert api(served, "GET", "/v1/caches/" + entry["name"]).json()["id"] == entry["id"]
    assert entry["id"] in [row["id"] for row in api(served, "GET", "/v1/caches").json()["data"]]

    longer = api(served, "PATCH", "/v1/caches/" + entry["id"], json={"ttl": 900}).json()
    assert datetime.fromisoformat(longer["expire_time"]) > expire
    assert longer["update_time"] >= longer["create_time"] and longer["usage"]["cached_tokens"] > 0
    when = (datetime.now(UTC) + timedelta(seconds=120)).strftime("%Y-%m-%dT%H:%M:%SZ")
    shorter = api(served, "PATCH", "/v1/caches/" + entry["id"], json={"expire_time": when}).json()
    assert datetime.fromisoformat(shorter["expire_time"]) == datetime.fromisoformat(when)

    before = retained_pages(served)
    gone = api(served, "DELETE", "/v1/caches/" + entry["id"]).json()
    assert gone == {"id": entry["id"], "object": "cache.deleted", "deleted": True}
    assert retained_pages(served) == before - total // PAGE  # released at once
    assert api(served, "GET", "/v1/caches/" + entry["id"]).status_code == 404
    with pytest.raises(openai.BadRequestError) as err:
        openai_client(served).chat.completions.create(
            model=served[1], messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            extra_body={"cached_content": entry["id"]},
        )  # fmt: skip
    assert err.value.body["param"] == "cached_content" and err.value.body["code"] == "cached_content_not_found"


def test_a_prompt_entry_on_completions_and_a_chat_entry_on_messages_and_responses(served):
    text = f"[{uuid.uuid4().hex[:8]}] " + " ".join(f"fact {i}." for i in range(30))
    entry = create(served, prompt=text)
    assert entry["kind"] == "prompt"
    total = entry["usage"]["total_tokens"]
    done = openai_client(served).completions.create(
        model=served[1], prompt=" So", max_tokens=1, extra_body={"cached_content": entry["id"]}
    )
    assert done.usage.prompt_tokens == total + 1
    assert done.usage.prompt_tokens_details.cached_tokens == total // PAGE * PAGE

    with pytest.raises(openai.BadRequestError) as err:  # a prompt entry on a chat route
        openai_client(served).chat.completions.create(
            model=served[1], messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            extra_body={"cached_content": entry["id"]},
        )  # fmt: skip
    assert err.value.body["param"] == "cached_content" and "holds prompt" in err.value.body["message"]

    chat = chat_entry(served)
    whole = chat["usage"]["total_tokens"] // PAGE * PAGE
    claude = anthropic.Anthropic(base_url=served[0], api_key="alice-key", max_retries=0)
    message = claude.messages.create(
        model=served[1], max_tokens=1, messages=[{"role": "user", "content": "Hi"}],
        extra_body={"cached_content": chat["name"]},
    )  # fmt: skip
    assert message.usage.cache_read_input_tokens >= whole
    response = openai_client(served).responses.create(
        model=served[1], input="Hi", max_output_tokens=1, store=False, extra_body={"cached_content": chat["id"]}
    )
    assert response.usage.input_tokens_details.cached_tokens >= whole


def test_tenants_see_and_use_only_their_own_entries(served):
    entry = chat_entry(served)
    path = "/v1/caches/" + entry["id"]
    for method, body in (("GET", None), ("PATCH", {"ttl": "5s"}), ("DELETE", None)):
        r = api(served, method, path, "bob-key", json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    assert entry["id"] not in [row["id"] for row in api(served, "GET", "/v1/caches", "bob-key").json()["data"]]
    with pytest.raises(openai.BadRequestError) as err:
        openai_client(served, "bob-key").chat.completions.create(
            model=served[1], messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            extra_body={"cached_content": entry["name"]},
        )  # fmt: skip
    assert err.value.body["param"] == "cached_content"
    r = api(
        served, "POST", "/v1/messages", "bob-key",
        json={"model": served[1], "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}],
              "cached_content": entry["id"]},
    )  # fmt: skip
    assert r.status_code == 400 and r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
    mine = api(served, "GET", path).json()  # alice lost nothing
    assert mine["expire_time"] == entry["expire_time"] and mine["usage"] == entry["usage"]
    rows = {row["id"]: row for row in api(served, "GET", "/v1/caches", "ops-key").json()["data"]}
    assert rows[entry["id"]]["tenant"] == "alice"  # the admin sees every tenant's
    assert api(served, "GET", path, "ops-key").json()["tenant"] == "alice"


def test_bad_bodies_bounds_expiry_and_pages(served):
    now = datetime.now(UTC)
    bad = [
        ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "a", "ttl": "60s", "expire_time": (now + timedelta(minutes=5)).isoformat()}, "ttl"),
        ({"prompt": "a", "ttl": "ten minutes"}, "ttl"),
        ({"prompt": "a", "ttl": 0}, "ttl"),
        ({"prompt": "a", "expire_time": (now - timedelta(minutes=5)).isoformat()}, "expire_time"),
        ({"prompt": "a", "expire_time": "2026-12-01T12:00:00"}, "expire_time"),  # no zone
        ({"prompt": [7] * (RETAINED_PAGES + 1) * PAGE}, "prompt"),  # could never be held whole
        ({"messages": [{"role": "robot", "content": "a"}]}, "messages"),
    ]
    for body, param in bad:
        r = api(served, "POST", "/v1/caches", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert api(served, "GET", "/v1/caches", params={"page_token": "x"}).status_code == 400

    store = served[2].caches
    first, second, third = (create(served, "carol-key", prompt=f"carol {i}")["id"] for i in range(3))
    listed = api(served, "GET", "/v1/caches", "carol-key", params={"page_size": 2})
    page = listed.json()
    assert [row["id"] for row in page["data"]] == [third, second] and page["next_page_token"]
    # each row's own page token (how the Ray ingress resumes each replica mid-page), the last one the page's
    row_tokens = listed.headers[PAGE_TOKENS_HEADER].split(",")
    assert len(row_tokens) == 2 and row_tokens[-1] == page["next_page_token"]
    rest = api(served, "GET", "/v1/caches", "carol-key", params={"page_token": page["next_page_token"]}).json()
    assert [row["id"] for row in rest["data"]] == [first] and rest["next_page_token"] is None

    store.max_per_owner = 3
    try:
        r = api(served, "POST", "/v1/caches", "carol-key", json={"prompt": "one too many"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_caches"
    finally:
        store.max_per_owner = 1024
    store._entries[first].expire_time = time.time() - 1  # expired: gone from every route
    assert api(served, "GET", "/v1/caches/" + first, "carol-key").status_code == 404
    with pytest.raises(openai.BadRequestError):
        openai_client(served, "carol-key").completions.create(
            model=served[1], prompt="x", max_tokens=1, extra_body={"cached_content": first}
        )


def test_the_cli_against_the_server(served, capsys):
    from prefixkv.cli import main

    def cli(*argv: str) -> dict:
        assert main(["cache", *argv, "--url", served[0], "--api-key", "alice-key"]) == 0
        return json.loads(capsys.readouterr().out)

    made = cli("create", "--messages", '[{"role": "user", "content": "Remember 42."}]', "--ttl", "60s")
    assert made["kind"] == "messages"
    assert made["id"] in [row["id"] for row in cli("list")["data"]]
    assert cli("get", made["name"])["id"] == made["id"]
    assert cli("extend", made["id"], "--ttl", "120s")["expire_time"] > made["expire_time"]
    assert cli("delete", made["id"])["deleted"] is True
    assert main(["cache", "get", made["id"], "--url", served[0], "--api-key", "alice-key"]) == 2
    assert "404" in capsys.readouterr().err
