"""service/settings: the environment read into Settings, and clear errors for bad values."""

from __future__ import annotations

import pytest

from service.settings import Settings, SettingsError, parse_tokens


def test_tokens_map_to_tenants_and_a_bare_token_is_tenant_default():
    assert parse_tokens("acme:tok-acme-123, tok-bare-4567,,rival:tok-rival-89") == {
        "tok-acme-123": "acme",
        "tok-bare-4567": "default",
        "tok-rival-89": "rival",
    }


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("acme:short", "at least 8 characters"),
        ("bad tenant!:tok-12345678", "must be 1-64 letters"),
        ("a:tok-12345678,b:tok-12345678", "one token is given to two tenants"),
    ],
)
def test_bad_tokens_are_refused_naming_the_entry(raw, says):
    with pytest.raises(SettingsError, match=says):
        parse_tokens(raw)


def test_defaults_and_overrides_from_the_environment(tmp_path):
    s = Settings.from_env({"PSTAR_DATA_DIR": str(tmp_path)})
    assert (s.data_dir, s.db_url) == (tmp_path, f"sqlite:///{tmp_path / 'store.db'}")
    assert (s.max_upload_bytes, s.ray_address, s.api_docs, s.tokens) == (1 << 30, None, True, {})
    s = Settings.from_env(
        {
            "PSTAR_DATA_DIR": str(tmp_path),
            "PSTAR_DB_URL": "postgresql+psycopg://u@h/db",
            "PSTAR_MAX_UPLOAD_BYTES": "1024",
            "RAY_ADDRESS": "http://head:8265",
            "PSTAR_API_DOCS": "off",
            "PSTAR_API_TOKENS": "acme:tok-acme-123",
        }
    )
    assert (s.db_url, s.max_upload_bytes, s.ray_address, s.api_docs) == (
        "postgresql+psycopg://u@h/db",
        1024,
        "http://head:8265",
        False,
    )
    assert s.tokens == {"tok-acme-123": "acme"}


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("PSTAR_MAX_UPLOAD_BYTES", "1GB", "whole number of bytes"),
        ("PSTAR_MAX_UPLOAD_BYTES", "0", "must be positive"),
        ("PSTAR_API_DOCS", "maybe", "'on' or 'off'"),
    ],
)
def test_bad_values_name_the_variable(tmp_path, name, value, says):
    with pytest.raises(SettingsError, match=f"{name} {says}|{name} must be.*{says}"):
        Settings.from_env({"PSTAR_DATA_DIR": str(tmp_path), name: value})
