"""PSTAR_API_DOCS=off: no documentation routes; the API itself is unchanged."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.app import create_app
from service.control.launcher import DryLauncher
from service.settings import Settings
from service.store import Store


def test_with_docs_off_the_documentation_routes_do_not_exist(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.migrate()
    settings = Settings(
        data_dir=tmp_path, db_url=store.url, tokens={"tok-acme-123": "acme"}, api_docs=False
    )
    settings.ensure_dirs()
    try:
        with TestClient(create_app(settings, store, DryLauncher())) as http:
            for path in ("/docs", "/redoc", "/openapi.json"):
                r = http.get(path)
                assert r.status_code == 404, path
                assert r.json()["error"]["code"] == "unknown_url"
            auth = {"Authorization": "Bearer tok-acme-123"}
            assert http.get("/v1/models", headers=auth).status_code == 200
            # a 405 still names the allowed methods (they come from the app's schema)
            r = http.put("/v1/files", headers=auth)
            assert (r.status_code, r.headers["allow"]) == (405, "GET, POST")
    finally:
        store.close()


def test_the_schema_says_no_string_parameter_holds_nul(tmp_path):
    # the API answers 400 to U+0000 in any path or query string; the schema says so
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.migrate()
    settings = Settings(data_dir=tmp_path, db_url=store.url, tokens={"tok-acme-123": "acme"})
    settings.ensure_dirs()
    try:
        with TestClient(create_app(settings, store, DryLauncher())) as http:
            schema = http.get("/openapi.json").json()
            params = schema["paths"]["/v1/files"]["get"]["parameters"]
            after = next(p for p in params if p["name"] == "after")["schema"]
            patterns = [after.get("pattern")] + [s.get("pattern") for s in after.get("anyOf", [])]
            assert "^[^\\u0000]*$" in patterns
            auth = {"Authorization": "Bearer tok-acme-123"}
            r = http.get("/v1/files", params={"after": "a\x00b"}, headers=auth)
            assert r.status_code == 400
            assert "NUL" in r.json()["error"]["message"]
    finally:
        store.close()
