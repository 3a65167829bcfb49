"""Fixtures of the service tests."""

from __future__ import annotations

import pytest

from service.settings import Settings
from service.store import Store


@pytest.fixture
def local_service(tmp_path):
    """(settings, store): a data dir and a migrated SQLite store in `tmp_path`."""
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.migrate()
    settings = Settings(data_dir=tmp_path, db_url=store.url, tokens={"tok-acme-123": "acme"})
    settings.ensure_dirs()
    yield settings, store
    store.close()


@pytest.fixture
def env(local_service):
    """`local_service` with the tiny Llama as base model `tiny-llama` (the serving and
    storage tests make fine-tuned models of it)."""
    from tests.tiny import make_tiny_llama

    settings, _ = local_service
    make_tiny_llama(settings.models_dir / "tiny-llama")
    return local_service


@pytest.fixture
def fresh_store(db_url):
    """A store migrated now, on each backend (`db_url`)."""
    s = Store(db_url)
    s.migrate()
    yield s
    s.close()
