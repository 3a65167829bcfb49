"""PSTAR_API_DOCS=off: no documentation routes; the API itself is unchanged."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.app import create_app
from service.launcher import DryLauncher
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
