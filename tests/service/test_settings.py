"""service/settings: the environment read into Settings, and clear errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.settings import Settings, SettingsError, job_env, parse_tokens


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
    assert s.embedding_model is None
    (tmp_path / "mini-embedder").mkdir()
    s = Settings.from_env(
        {"PSTAR_DATA_DIR": str(tmp_path), "PSTAR_EMBEDDING_MODEL": str(tmp_path / "mini-embedder")}
    )
    assert (s.embedding_model, s.embedding_model_name) == (
        tmp_path / "mini-embedder",
        "mini-embedder",
    )


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("PSTAR_MAX_UPLOAD_BYTES", "1GB", "whole number of bytes"),
        ("PSTAR_MAX_UPLOAD_BYTES", "0", "must be positive"),
        ("PSTAR_API_DOCS", "maybe", "'on' or 'off'"),
        ("PSTAR_SESSION_ENGINES", "gpu", "'local'"),
        ("PSTAR_EMBEDDING_MODEL", "/no/such/dir", "a directory"),
    ],
)
def test_bad_values_name_the_variable(tmp_path, name, value, says):
    with pytest.raises(SettingsError, match=f"{name} {says}|{name} must be.*{says}"):
        Settings.from_env({"PSTAR_DATA_DIR": str(tmp_path), name: value})


def test_default_job_resources_from_the_environment_under_what_a_request_says(tmp_path):
    from service.control.jobs import JobService
    from service.spec.request import JobRequest

    raw = (
        '{"num_workers": 4, "use_gpu": true, "cpus_per_worker": 8, "placement_strategy": "SPREAD"}'
    )
    s = Settings.from_env({"PSTAR_DATA_DIR": str(tmp_path), "PSTAR_DEFAULT_RESOURCES": raw})
    default = {
        "num_workers": 4,
        "use_gpu": True,
        "cpus_per_worker": 8,
        "placement_strategy": "SPREAD",
    }
    assert s.default_resources == default
    service = JobService(s, store=None, launcher=None)
    base = {"model": "m", "training_file": "file-1"}
    silent = service._with_default_resources(JobRequest(**base))
    assert silent.resources.model_dump(exclude_none=True) == s.default_resources
    told = service._with_default_resources(JobRequest(**base, resources={"num_workers": 2}))
    assert told.resources.model_dump(exclude_none=True) == {**default, "num_workers": 2}
    plain = JobService(Settings.from_env({"PSTAR_DATA_DIR": str(tmp_path)}), None, None)
    assert plain._with_default_resources(JobRequest(**base)).resources.use_gpu is False


@pytest.mark.parametrize("raw", ['{"use_gpu": "yes"}', "[1]", '{"gpus": 1}', "{"])
def test_bad_default_resources_are_refused(tmp_path, raw):
    with pytest.raises(SettingsError, match="PSTAR_DEFAULT_RESOURCES must be a JSON object"):
        Settings.from_env({"PSTAR_DATA_DIR": str(tmp_path), "PSTAR_DEFAULT_RESOURCES": raw})


class _Cluster:
    """A launcher that reports a cluster: two GPU nodes of different shapes, one CPU node."""

    def cluster_nodes(self):
        return [{"CPU": 96.0, "GPU": 8.0}, {"CPU": 32.0, "GPU": 4.0}, {"CPU": 64.0}]


def test_a_gpu_job_that_names_no_cpus_gets_its_share_of_a_gpu_node(tmp_path):
    from service.control.jobs import JobService
    from service.spec.request import JobRequest

    service = JobService(Settings.from_env({"PSTAR_DATA_DIR": str(tmp_path)}), None, _Cluster())
    base = {"model": "m", "training_file": "file-1"}
    gpu = service._with_default_resources(JobRequest(**base, resources={"use_gpu": True}))
    assert gpu.resources.cpus_per_worker == 8.0  # min(96/8, 32/4): fits either GPU node
    told = JobRequest(**base, resources={"use_gpu": True, "cpus_per_worker": 2})
    assert service._with_default_resources(told).resources.cpus_per_worker == 2
    cpu = service._with_default_resources(JobRequest(**base))
    assert cpu.resources.cpus_per_worker == 1.0  # CPU jobs: as asked (default 1)


def test_the_store_url_can_come_from_a_file_which_wins_over_the_variable(tmp_path):
    f = tmp_path / "db_url"
    f.write_text("postgresql+psycopg://u:pw@db/pstar\n")
    env = {"PSTAR_DATA_DIR": str(tmp_path), "PSTAR_DB_URL": "sqlite:///x.db"}
    got = Settings.from_env({**env, "PSTAR_DB_URL_FILE": str(f)})
    assert got.db_url == "postgresql+psycopg://u:pw@db/pstar"
    with pytest.raises(SettingsError, match=r"PSTAR_DB_URL_FILE=.*cannot read"):
        Settings.from_env({**env, "PSTAR_DB_URL_FILE": str(tmp_path / "nope")})
    f.write_text("\n")
    with pytest.raises(SettingsError, match="is empty"):
        Settings.from_env({**env, "PSTAR_DB_URL_FILE": str(f)})


def test_a_ray_jobs_environment_names_where_the_url_is_never_the_url(tmp_path):
    data = tmp_path / "data"
    default = Settings.from_env({"PSTAR_DATA_DIR": str(data)})
    # the data dir says it all, and where the workers reach the API (no secret in either)
    assert job_env(default) == {
        "PSTAR_DATA_DIR": str(data), "PSTAR_API_URL": "http://127.0.0.1:8000",
    }  # fmt: skip
    url = "postgresql+psycopg://pstar:s3cret-pw@db:5432/pstar"
    pg = Settings.from_env({"PSTAR_DATA_DIR": str(data), "PSTAR_DB_URL": url})
    env = job_env(pg)
    assert "s3cret-pw" not in repr(env)
    path = Path(env["PSTAR_DB_URL_FILE"])
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    # a driver with only that environment finds the same store
    assert Settings.from_env(env).db_url == url
    moved = Settings.from_env({"PSTAR_DATA_DIR": str(data), "PSTAR_DB_URL": url + "2"})
    assert Settings.from_env(job_env(moved)).db_url == url + "2"  # rewritten when it changes


def test_spill_goes_to_the_spill_volume_per_job_and_ray_jobs_are_told_where(tmp_path):
    data = tmp_path / "data"
    default = Settings.from_env({"PSTAR_DATA_DIR": str(data)})
    assert default.spill_dir("ftjob-1") == data / "spill" / "ftjob-1"
    assert "PSTAR_SPILL_DIR" not in job_env(default)
    node_local = Settings.from_env({"PSTAR_DATA_DIR": str(data), "PSTAR_SPILL_DIR": "/spill"})
    assert node_local.spill_dir("ftjob-1") == Path("/spill/ftjob-1")
    # the driver reads its settings from the job's environment: the same place
    assert Settings.from_env(job_env(node_local)).spill_dir("ftjob-1") == Path("/spill/ftjob-1")


def test_a_token_may_be_given_as_its_sha256_and_only_the_secret_gets_in():
    from api.auth import tenant_of
    from service.store.keys import key_hash

    secret = "pstar-the-secret-itself"
    tokens = parse_tokens(f"acme:sha256:{key_hash(secret)},rival:plain-token-1")
    assert tokens == {f"sha256:{key_hash(secret)}": "acme", "plain-token-1": "rival"}
    assert tenant_of(tokens, secret) == "acme"
    assert tenant_of(tokens, f"sha256:{key_hash(secret)}") is None  # the hash is no key
    assert tenant_of(tokens, "plain-token-1") == "rival"
    assert parse_tokens(f"sha256:{key_hash(secret)}") == {f"sha256:{key_hash(secret)}": "default"}
    with pytest.raises(SettingsError, match="64 lower-case hex"):
        parse_tokens("acme:sha256:abc")


def test_pstar_keys_hash_prints_the_form_the_tokens_variable_takes():
    from typer.testing import CliRunner

    from pstar.cli import app
    from service.store.keys import key_hash

    out = CliRunner().invoke(app, ["keys", "hash"], input="pstar-the-secret-itself\n")
    assert out.exit_code == 0, out.output
    assert out.output.strip() == f"sha256:{key_hash('pstar-the-secret-itself')}"


def test_session_engines_are_ray_actors_unless_local_is_asked(tmp_path):
    """The service's default puts each training model's engines in Ray actors; with no
    address given, the control plane reaches the cluster through Ray's client on the job
    server's host (KubeRay's head service has the client port, 10001)."""
    from service.control.control_plane import client_address

    default = Settings.from_env({"PSTAR_DATA_DIR": str(tmp_path)})
    assert (default.session_engines, default.session_ray_address) == ("ray", None)
    local = Settings.from_env({"PSTAR_DATA_DIR": str(tmp_path), "PSTAR_SESSION_ENGINES": "local"})
    assert local.session_engines == "local"
    assert client_address("http://pstar-head-svc:8265") == "ray://pstar-head-svc:10001"
    assert client_address("10.0.0.5:8265") == "ray://10.0.0.5:10001"
    assert client_address("http://[fd00::5]:8265") == "ray://[fd00::5]:10001"
    ray = Settings.from_env(
        {
            "PSTAR_DATA_DIR": str(tmp_path),
            "PSTAR_SESSION_ENGINES": " Ray ",
            "PSTAR_SESSION_RAY_ADDRESS": "10.0.0.5:6379",
        }
    )
    assert (ray.session_engines, ray.session_ray_address) == ("ray", "10.0.0.5:6379")


def test_a_ray_client_address_answers_only_where_something_listens():
    import socket

    from service.control.control_plane import answers

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert answers(f"ray://127.0.0.1:{port}")
    assert not answers(f"ray://127.0.0.1:{port}", timeout_s=1.0)  # closed now


def test_the_api_url_jobs_reach_is_checked_and_carried_to_their_drivers(tmp_path):
    env = {"PSTAR_DATA_DIR": str(tmp_path), "PSTAR_API_URL": "http://pstar-api.ns.svc:8000/v1/"}
    got = Settings.from_env(env)
    assert got.api_url == "http://pstar-api.ns.svc:8000"
    assert Settings.from_env(job_env(got)).api_url == got.api_url
    for bad in ("pstar-api:8000", "http://user:pw@host:8000", "ftp://host"):
        with pytest.raises(SettingsError, match="PSTAR_API_URL"):
            Settings.from_env({**env, "PSTAR_API_URL": bad})
