"""Many API keys, tenants and the admin endpoints, on the real engine behind a real server and the official client.

Keys come from a key file (tenant alice has two keys, bob one, ops is the admin). Each test starts from an empty
prefix cache on a module engine (one per prefix cache kind where the cache matters) and serves it for its own
duration, so no test sees another's cached prompts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from prefixkv.engine.engine import Engine
from prefixkv.server.auth import KeyFileError, read_key_file
from tests.server.live_server import running_server, wait_no_pages_held

KEY_FILE = """\
# key           tenant  role
alice-key-1     alice
alice-key-2     alice   user
bob-key         bob     user
ops-key         ops     admin
"""
ADMIN = {"Authorization": "Bearer ops-key"}
# long enough (> 2 pages of 16 tokens) for the prefix cache to serve a repeat of it
SECRET = (
    "Bob's private notes, never to be shared: the merger closes on Friday, the code word is heron, and "
    "the board meets at nine in the small room. Summary:"
)
OTHER = (
    "Alice's quarterly plan, for her eyes only: hire two engineers, ship the mobile app, move the billing "
    "service to the new cluster before the audit, and renegotiate the office lease. Next step:"
)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEY_FILE)
    return str(path)


@pytest.fixture(scope="module")
def engines(new_engine):
    """engines(kind) -> an idle engine with an empty prefix cache (built once per kind, small pool)."""
    built: dict[str, Engine] = {}

    def get(kind: str) -> Engine:
        if kind not in built:
            built[kind] = new_engine(prefix_cache=kind, kv_cache_tokens=4096)
        assert built[kind].reset_prefix_cache() is True
        return built[kind]

    return get


def _client(base: str, key: str, path: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + path, api_key=key, max_retries=0, timeout=120)


def _cached(base: str, key: str, prompt: str, **extra) -> int:
    """Prompt tokens the prefix cache served for one greedy 1-token completion sent with `key`."""
    client = _client(base, key)
    out = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra or None
    )
    return out.usage.prompt_tokens_details.cached_tokens


def test_key_file_format_and_errors(tmp_path):
    """`KEY TENANT [ROLE]` per line, comments and blanks skipped; a malformed line is named, the key never is."""
    good = tmp_path / "good.txt"
    good.write_text(KEY_FILE)
    assert [(k, p.tenant, p.role) for k, p in read_key_file(str(good))] == [
        ("alice-key-1", "alice", "user"),
        ("alice-key-2", "alice", "user"),
        ("bob-key", "bob", "user"),
        ("ops-key", "ops", "admin"),
    ]
    cases = [
        ("k1 alice\nsecret-key-2\n", "line 2: expected 'KEY TENANT [ROLE]'"),
        ("# c\n\nk1 alice user extra\n", "line 3: expected 'KEY TENANT [ROLE]'"),
        ("k1 alice root\n", "line 1: role must be 'user' or 'admin', got 'root'"),
        ("k1 alice\nk1 bob\n", "line 2: this key is already given on line 1"),
        ("# only a comment\n", "has no keys"),
    ]
    for text, message in cases:
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(KeyFileError) as err:
            read_key_file(str(bad))
        assert message in str(err.value) and str(bad) in str(err.value), str(err.value)
        assert "secret-key-2" not in str(err.value)
    with pytest.raises(KeyFileError, match="cannot read API key file"):
        read_key_file(str(tmp_path / "missing.txt"))


def test_serve_rejects_malformed_key_file_before_loading(tmp_path):
    """`prefixkv serve --api-key-file` with a bad line exits 2 at once, naming the file and the line."""
    bad = tmp_path / "keys.txt"
    bad.write_text("alice-key alice\nbob-key\n")
    env = {**os.environ, "PREFIXKV_NO_NATIVE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "prefixkv.server", "--api-key-file", str(bad), "--port", "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"API key file {bad}, line 2: expected 'KEY TENANT [ROLE]'" in proc.stderr


def test_alice_cannot_get_bobs_hits_even_as_user_bob(engines, key_file):
    """api-key isolation (the default with a key file): the salt comes from the key's tenant, so naming
    another tenant in `user` or `cache_salt` reaches nothing of theirs."""
    with running_server(engines("hash"), api_key_file=key_file) as (base, _, _):
        assert _cached(base, "bob-key", SECRET) == 0
        assert _cached(base, "bob-key", SECRET) >= 32  # bob's own repeat hits
        assert _cached(base, "alice-key-1", SECRET, user="bob") == 0
        assert _cached(base, "alice-key-1", SECRET, user="bob", cache_salt="bob") == 0
        assert _cached(base, "ops-key", SECRET) == 0  # an admin is a tenant of its own here too
        wait_no_pages_held(base, ADMIN)


def test_two_keys_of_one_tenant_share_hits(engines, key_file):
    with running_server(engines("hash"), api_key_file=key_file) as (base, _, _):
        assert _cached(base, "alice-key-1", OTHER) == 0
        assert _cached(base, "alice-key-2", OTHER) >= 32
        assert _cached(base, "bob-key", OTHER) == 0
        wait_no_pages_held(base, ADMIN)


def test_messages_are_isolated_by_tenant_too(engines, key_file):
    """/v1/messages with Anthropic's x-api-key: a breakpoint cached by bob is read by bob's repeat only, not by
    alice, not even when she names bob in metadata.user_id."""
    system = [{"type": "text", "text": SECRET, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]

    def read(base: str, key: str, **extra) -> int:
        client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)
        reply = client.messages.create(
            model=_client(base, key).models.list().data[0].id,
            max_tokens=1,
            system=system,
            messages=[{"role": "user", "content": "go"}],
            **extra,
        )
        return reply.usage.cache_read_input_tokens

    with running_server(engines("hash"), api_key_file=key_file) as (base, _, _):
        assert read(base, "bob-key") == 0
        assert read(base, "bob-key") >= 32
        assert read(base, "alice-key-1") == 0
        assert read(base, "alice-key-2", metadata={"user_id": "bob"}) >= 32  # alice's own entry now: hers to read
        assert read(base, "ops-key", metadata={"user_id": "bob"}) == 0
        wait_no_pages_held(base, ADMIN)


def test_user_keys_get_403_on_admin_endpoints(engines, key_file):
    """Resetting the cache and the radix tree (prompt text) need an admin key: a tenant key gets a 403 in
    OpenAI's error format; models, /metrics and its own summary stay open to it; a wrong key is a 401."""
    with running_server(engines("radix"), api_key_file=key_file) as (base, _, _):
        _cached(base, "bob-key", SECRET)
        user = _client(base, "alice-key-1", path="")
        for call in (
            lambda: user.post("/reset_prefix_cache", cast_to=object),
            lambda: user.post("/reset_prefix_cache?tenant=bob", cast_to=object),
            lambda: user.get("/cache/tree", cast_to=str),
        ):
            with pytest.raises(openai.PermissionDeniedError) as err:
                call()
            assert err.value.status_code == 403
            body = err.value.response.json()
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["code"] == "permission_denied" and "admin" in body["error"]["message"]
        assert httpx.get(base + "/metrics", headers={"Authorization": "Bearer alice-key-1"}).status_code == 200
        assert _client(base, "alice-key-1").models.list().data
        with pytest.raises(openai.AuthenticationError):
            _client(base, "nobody", path="").get("/cache/summary", cast_to=object)
        admin = _client(base, "ops-key", path="")
        tree = httpx.get(base + "/cache/tree", headers=ADMIN)
        assert tree.status_code == 200 and "merger closes" in tree.text
        assert admin.post("/reset_prefix_cache", cast_to=object) == {"reset": True}
        wait_no_pages_held(base, ADMIN)


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_admin_resets_one_tenant(engines, key_file, kind):
    """?tenant=alice drops alice's namespaces only: bob's next repeat still hits."""
    with running_server(engines(kind), api_key_file=key_file) as (base, _, _):
        for key, prompt in (("alice-key-1", OTHER), ("bob-key", SECRET)):
            _cached(base, key, prompt)
            _cached(base, key, prompt, cache_salt="second namespace")
        admin = _client(base, "ops-key", path="")
        assert admin.post("/reset_prefix_cache?tenant=alice", cast_to=object) == {"reset": True, "tenant": "alice"}
        assert _cached(base, "alice-key-2", OTHER) == 0
        assert _cached(base, "alice-key-1", OTHER, cache_salt="second namespace") == 0
        assert _cached(base, "bob-key", SECRET) >= 32
        assert _cached(base, "bob-key", SECRET, cache_salt="second namespace") >= 32
        with pytest.raises(openai.BadRequestError) as err:
            admin.post("/reset_prefix_cache?tenant=carol", cast_to=object)
        assert err.value.response.json()["error"]["param"] == "tenant"
        wait_no_pages_held(base, ADMIN)


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_summary_as_tenant_shows_only_its_namespace(engines, key_file, kind):
    with running_server(engines(kind), api_key_file=key_file) as (base, _, _):
        for _ in range(2):
            _cached(base, "alice-key-1", OTHER)
            _cached(base, "bob-key", SECRET)
        _cached(base, "bob-key", SECRET, cache_salt="bob's other namespace")
        wait_no_pages_held(base, ADMIN)

        admin = httpx.get(base + "/cache/summary", headers=ADMIN).json()
        tenants = sorted(row["tenant"] for row in admin["by_namespace"])
        assert tenants == ["alice", "bob", "bob"]  # the admin sees every namespace, named
        assert admin["hits"] > 0 and "engine" in admin

        alice = _client(base, "alice-key-2", path="").get("/cache/summary", cast_to=object)
        assert alice["tenant"] == "alice" and alice["type"] == kind
        assert len(alice["by_namespace"]) == 1 and alice["by_namespace"][0]["cached_tokens"] >= 32
        alice_salt = alice["by_namespace"][0]["cache_salt"]
        bob_salts = {row["cache_salt"] for row in admin["by_namespace"] if row["tenant"] == "bob"}
        assert alice_salt not in bob_salts and not any(s in str(alice) for s in bob_salts)
        assert not {"hits", "queries", "hit_rate", "engine", "kv_pages_used", "top_prefix_text"} & set(alice)
        if kind == "radix":
            assert alice["by_namespace"][0]["hits"] == 1
            assert [p["cache_salt"] for p in alice["top_prefixes"]] == [alice_salt]
        assert "Bob" not in str(alice) and "Alice" not in str(alice)  # never prompt text


def test_user_mode_trusts_user_within_a_keys_tenant(engines, key_file):
    """`--tenant-isolation user` with keys: `user` splits a tenant's cache (as a proxy sets it), but a key of
    another tenant that sends the same `user` still reaches nothing."""
    with running_server(engines("hash"), api_key_file=key_file, tenant_isolation="user") as (base, _, _):
        assert _cached(base, "alice-key-1", SECRET, user="u1") == 0
        assert _cached(base, "alice-key-2", SECRET, user="u1") >= 32
        assert _cached(base, "alice-key-1", SECRET, user="u2") == 0
        assert _cached(base, "bob-key", SECRET, user="u1") == 0
        wait_no_pages_held(base, ADMIN)


def test_no_keys_stays_open(engines):
    """No key configured (a local dev server): every endpoint answers without a key, the admin ones too."""
    with running_server(engines("radix")) as (base, _, _):
        _cached(base, "anything", SECRET)
        assert "merger closes" in httpx.get(base + "/cache/tree").text
        assert httpx.get(base + "/cache/summary").json()["type"] == "radix"
        assert httpx.post(base + "/reset_prefix_cache").json() == {"reset": True}
        wait_no_pages_held(base, {})
