"""`rein migrate` and `rein api` refuse a database or Redis URL whose password is a placeholder
(deploy/k8s/base/secret.yaml's CHANGE-ME), naming the setting, before anything connects: the
URLs point at a port nothing listens on, so reaching a server would fail differently."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rein.cli.main import main
from rein.core.settings import Settings, SettingsError, refuse_placeholder_secrets

SECRET = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "secret.yaml"
NOWHERE = "127.0.0.1:9"   # the discard port: nothing answers there


@pytest.mark.parametrize("password", ["CHANGE-ME", "changeme", "change_me", "<change-me>", "REPLACE-ME"])
def test_a_placeholder_database_password_is_refused(password: str) -> None:
    settings = Settings(database_url=f"postgresql+psycopg://rein:{password}@{NOWHERE}/rein")
    with pytest.raises(SettingsError, match="REIN_DATABASE_URL: its password is the placeholder") as raised:
        refuse_placeholder_secrets(settings)
    assert "REIN_REDIS_URL" not in str(raised.value)


def test_both_urls_are_named() -> None:
    settings = Settings(database_url=f"postgresql+psycopg://rein:CHANGE-ME@{NOWHERE}/rein",
                        redis_url=f"rediss://:CHANGE-ME@{NOWHERE}/0?ssl_cert_reqs=required")
    with pytest.raises(SettingsError) as raised:
        refuse_placeholder_secrets(settings)
    assert "REIN_DATABASE_URL" in str(raised.value) and "REIN_REDIS_URL" in str(raised.value)


@pytest.mark.parametrize("database_url, redis_url", [
    ("postgresql+psycopg://postgres@127.0.0.1:5432/rein", "redis://127.0.0.1:6379/0"),   # the defaults
    ("postgresql+psycopg://rein:s3cr3t-Change-Me-Not@db/rein", "redis://:rein@redis:6379/0"),
    ("postgresql+psycopg://rein:Xk9%40changeme@db/rein", "rediss://default:9f8e7d@redis:6380/0"),
])
def test_real_passwords_and_none_pass(database_url: str, redis_url: str) -> None:
    refuse_placeholder_secrets(Settings(database_url=database_url, redis_url=redis_url))


def test_the_shipped_kubernetes_secret_is_refused() -> None:
    """What `kubectl apply -k deploy/k8s/base` would hand the pods unedited."""
    (secret,) = [doc for doc in yaml.safe_load_all(SECRET.read_text())
                 if doc and doc["metadata"]["name"] == "rein-services"]
    urls = secret["stringData"]
    with pytest.raises(SettingsError) as raised:
        refuse_placeholder_secrets(Settings(database_url=urls["REIN_DATABASE_URL"], redis_url=urls["REIN_REDIS_URL"]))
    assert "REIN_DATABASE_URL" in str(raised.value) and "REIN_REDIS_URL" in str(raised.value)


@pytest.mark.parametrize("command", [["migrate"], ["migrate", "--check"], ["api"]])
def test_migrate_and_api_exit_2_naming_the_setting(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REIN_DATABASE_URL", f"postgresql+psycopg://rein:rein-db-pass@{NOWHERE}/rein")
    monkeypatch.setenv("REIN_REDIS_URL", f"redis://:CHANGE-ME@{NOWHERE}/0")
    assert main(command) == 2
    error = capsys.readouterr().err
    assert "REIN_REDIS_URL: its password is the placeholder 'CHANGE-ME'" in error, error
    assert "REIN_DATABASE_URL" not in error
