"""API keys in the store (service/store/keys.py, api/routes/admin.py, `pstar keys`): an
admin key makes and revokes tenants' keys; a key's secret is shown once and stored only
as its SHA-256; a tenant's key acts as that tenant, through the unmodified SDK; admin and
tenant keys each reach only their own routes; a revoked key is a 401."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys

import httpx
import openai
import pytest

from api.auth import KeyCache
from tests.api.conftest import TOKENS, start_api
from tests.tiny import chat_lines

KEYS = "/v1/admin/keys"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("keys")
    server, stop = start_api(data_dir, f"sqlite:///{data_dir / 'store.db'}", "sqlite")
    yield server
    stop()


@pytest.fixture(scope="module")
def admin(api) -> dict[str, str]:
    _, secret = api.store.keys.create("ignored", "admin", "the operator's")
    return {"Authorization": f"Bearer {secret}"}


def sdk(api, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.base, api_key=secret, max_retries=0)


def test_an_admin_key_makes_a_tenants_key_that_works_through_the_sdk(api, admin):
    r = httpx.post(api.url + KEYS, json={"tenant": "acme", "name": "ci"}, headers=admin)
    assert r.status_code == 200, r.text
    made = r.json()
    secret = made["key"]
    assert secret.startswith("tml-")  # the form the Tinker SDK takes
    assert (made["tenant"], made["role"], made["hint"]) == ("acme", "tenant", secret[-4:])
    # the new key is tenant acme: it sees acme's file, as acme's other token does
    f = api.client("acme").files.create(
        file=("t.jsonl", io.BytesIO("\n".join(chat_lines(4)).encode())), purpose="fine-tune"
    )
    assert f.id in [x.id for x in sdk(api, secret).files.list()]
    assert f.id not in [x.id for x in api.client("rival").files.list()]
    # listed without its secret, which the store never held
    listed = httpx.get(api.url + KEYS, params={"tenant": "acme"}, headers=admin).json()["data"]
    assert [k["id"] for k in listed] == [made["id"]]
    assert listed[0]["key"] is None
    stored = (api.settings.data_dir / "store.db").read_bytes()
    for path in api.settings.data_dir.glob("store.db*"):
        stored += path.read_bytes()
    assert secret.encode() not in stored
    assert api.store.keys.find(secret).hash != secret


def test_each_kind_of_key_reaches_only_its_own_routes(api, admin):
    tenant = {"Authorization": f"Bearer {TOKENS['acme']}"}
    r = httpx.get(api.url + KEYS, headers=tenant)
    assert (r.status_code, r.json()["error"]["code"]) == (403, "permission_denied")
    r = httpx.get(api.base + "/files", headers=admin)
    assert (r.status_code, r.json()["error"]["code"]) == (403, "permission_denied")
    assert "nothing else" in r.json()["error"]["message"]
    r = httpx.post(api.url + KEYS, json={"tenant": "acme"})
    assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")
    # a tenant's name is checked as PSTAR_API_TOKENS' are
    r = httpx.post(api.url + KEYS, json={"tenant": "../x"}, headers=admin)
    assert r.status_code == 400, r.text


def test_a_key_revoked_through_the_api_is_refused_at_once(api, admin):
    made = httpx.post(api.url + KEYS, json={"tenant": "rival"}, headers=admin).json()
    client = sdk(api, made["key"])
    assert client.files.list().data is not None  # works, and is cached now
    r = httpx.delete(f"{api.url}{KEYS}/{made['id']}", headers=admin)
    assert r.status_code == 200
    assert r.json()["revoked_at"] is not None
    with pytest.raises(openai.AuthenticationError):
        client.files.list()
    r = httpx.delete(f"{api.url}{KEYS}/key-nope", headers=admin)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "key_not_found")


class _CountingKeys:
    def __init__(self, store) -> None:
        self.store, self.finds = store, 0

    def find(self, secret):
        self.finds += 1
        return self.store.keys.find(secret)


def test_the_cache_asks_the_store_once_per_secret_and_ttl_wrong_or_right(api):
    counting = _CountingKeys(api.store)
    cache = KeyCache(type("S", (), {"keys": counting})(), ttl_s=60)
    _, secret = api.store.keys.create("acme")

    async def ask(s: str, n: int):
        return [await cache.lookup(s) for _ in range(n)]

    assert asyncio.run(ask(secret, 5)) == [("acme", "tenant")] * 5
    assert asyncio.run(ask("tml-wrong", 50)) == [None] * 50
    assert counting.finds == 2  # one query for each secret, however often it is presented
    # what another process revoked stays valid until its entry ends (a 0 s cache: at once)
    api.store.keys.revoke(api.store.keys.find(secret).id)
    assert asyncio.run(ask(secret, 1)) == [("acme", "tenant")]
    assert asyncio.run(KeyCache(api.store, ttl_s=0).lookup(secret)) is None


def test_pstar_keys_makes_lists_and_revokes_in_the_store(tmp_path):
    env = {**os.environ, "PSTAR_DATA_DIR": str(tmp_path), "COLUMNS": "200"}
    env.pop("PSTAR_DB_URL", None)

    def pstar(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "pstar", "keys", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    made = pstar("create", "acme", "--name", "laptop")
    secret = made.strip().splitlines()[-1]
    assert secret.startswith("tml-")
    key_id = made.split()[0]
    assert key_id.startswith("key-")
    admin = pstar("create", "--admin")
    assert "admin of ~admin" in admin
    listed = pstar("list")
    assert key_id in listed
    assert secret not in listed
    assert secret[-4:] in listed
    assert "revoked" in pstar("revoke", key_id)
    from service.store import Store

    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    assert store.keys.find(secret) is None
    store.close()
