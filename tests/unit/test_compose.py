"""deploy/docker-compose.yml (no stack, no container engine): valid under the Compose
Specification's schema (the copy vendored in check-jsonschema, the schema ``docker compose``
validates against), and the same ports and credentials as the settings' defaults, so the
stages and the CLI reach it unconfigured (docs/deployment.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from services.common.settings import CommonSettings

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "docker-compose.yml"


def _check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True, timeout=120)


def test_the_compose_file_is_valid_under_the_compose_specification(tmp_path):
    ok = _check(COMPOSE)
    assert ok.returncode == 0 and "ok -- validation done" in ok.stdout, ok.stdout + ok.stderr
    broken = tmp_path / "broken.yml"  # the check can fail: a misspelt key is refused
    broken.write_text(COMPOSE.read_text().replace("    healthcheck:\n", "    healthchek:\n", 1))
    bad = _check(broken)
    assert bad.returncode == 1 and "healthchek" in bad.stdout, bad.stdout + bad.stderr


def test_the_compose_stack_has_the_settings_default_ports_and_credentials():
    spec = yaml.safe_load(COMPOSE.read_text())["services"]
    s = CommonSettings()
    published = {name: {p.rsplit(":", 1)[0] for p in svc.get("ports", [])} for name, svc in spec.items()}
    assert published["kafka"] == {f"{s.kafka.bootstrap_servers}"}
    assert published["redis"] == {urlsplit(s.redis.url).netloc}
    assert published["mariadb"] == {f"127.0.0.1:{s.mysql.port}"}
    assert urlsplit(s.s3.endpoint_url).netloc in published["s3"]
    assert all(p.startswith("127.0.0.1:") for ports in published.values() for p in ports)  # loopback only
    db, minio = spec["mariadb"]["environment"], spec["s3"]["environment"]
    assert (db["MARIADB_DATABASE"], db["MARIADB_USER"], db["MARIADB_PASSWORD"]) == (
        s.mysql.database, s.mysql.user, s.mysql.password.get_secret_value())
    assert (minio["MINIO_ROOT_USER"], minio["MINIO_ROOT_PASSWORD"], minio["MINIO_REGION"]) == (
        s.s3.access_key, s.s3.secret_key.get_secret_value(), s.s3.region)
