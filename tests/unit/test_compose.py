"""docker-compose.yml is valid and says what the deployment needs (checked with `docker-compose config`).

CI installs the Debian `docker-compose` package in `.ci/run`; without it these tests are skipped.
`config` only parses and interpolates: no Docker engine is needed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = shutil.which("docker-compose")
SERVICES = {"redis", "worker-cpu", "worker-gpu", "watcher", "flower"}
# Variables of the caller's shell that docker-compose.yml reads; the tests set their own.
COMPOSE_VARIABLES = (
    "REDIS_PASSWORD",
    "MODEL_DIR",
    "DATA_DIR",
    "CPU_WORKERS",
    "CPU_QUEUES",
    "GPU_QUEUES",
    "GPU_PROVIDER",
    "TRT_FP16",
    "FLOWER_BIND",
    "FLOWER_BASIC_AUTH",
)

pytestmark = pytest.mark.skipif(
    COMPOSE is None,
    reason="docker-compose is not installed (apt-get install docker-compose; .ci/run installs it)",
)


def compose_config(tmp_path: Path, *args: str, **variables: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in COMPOSE_VARIABLES}
    env.update(variables)
    env_file = tmp_path / "empty.env"  # ignore any .env of the developer's
    env_file.write_text("")
    return subprocess.run(
        [str(COMPOSE), "--env-file", str(env_file), "-f", str(ROOT / "docker-compose.yml"), *args, "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def services(tmp_path: Path, *args: str, **variables: str) -> dict[str, Any]:
    done = compose_config(tmp_path, *args, REDIS_PASSWORD="s3cret", FLOWER_BASIC_AUTH="ops:pw", **variables)
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config["services"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("profile", [(), ("--profile", "gpu")])
def test_every_service_is_there(tmp_path: Path, profile: tuple[str, ...]) -> None:
    assert set(services(tmp_path, *profile)) == SERVICES


def test_config_fails_without_redis_password(tmp_path: Path) -> None:
    done = compose_config(tmp_path)
    assert done.returncode != 0
    assert "REDIS_PASSWORD" in done.stderr


def required_variables(tmp_path: Path, *args: str) -> list[str]:
    """The variables `docker-compose config` refuses to run without, found by running it: each
    refusal names one (`set NAME`), which is then given, until it runs."""
    given: dict[str, str] = {}
    for _ in range(len(COMPOSE_VARIABLES) + 1):
        done = compose_config(tmp_path, *args, **given)
        if done.returncode == 0:
            return list(given)
        missing = re.findall(r"set (\w+)", done.stderr)  # the refusal's own words come last
        assert missing, done.stderr
        given[missing[-1]] = "x:y"
    raise AssertionError(f"docker-compose config still fails with {given}")


def test_the_readme_and_the_compose_file_say_which_variables_are_required(tmp_path: Path) -> None:
    required = set(required_variables(tmp_path)) | set(required_variables(tmp_path, "--profile", "gpu"))
    assert required == {"REDIS_PASSWORD", "FLOWER_BASIC_AUTH"}
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Docker compose", 1)[1].split("\n## ", 1)[0]
    exports = [line for line in section.splitlines() if line.startswith("export ")]
    header = (ROOT / "docker-compose.yml").read_text().split("\nx-voxmill-env", 1)[0]
    for name in required:
        assert any(f"{name}=" in line for line in exports), f"README's compose section: no export of {name}"
        assert f"export {name}=" in header and "required" in header.split(f"export {name}=")[1].split("\n")[0]


def test_redis_has_aof_a_password_and_a_healthcheck(tmp_path: Path) -> None:
    redis = services(tmp_path)["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--requirepass") + 1] == "s3cret"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"  # Celery's queues
    assert "ping" in " ".join(redis["healthcheck"]["test"])
    assert any(v.endswith(":/data") or ":/data:" in v for v in _volumes(redis))


def test_every_worker_uses_the_password_protected_broker(tmp_path: Path) -> None:
    config = services(tmp_path, "--profile", "gpu")
    for name in ("worker-cpu", "worker-gpu", "watcher", "flower"):
        assert config[name]["environment"]["VOXMILL_BROKER_URL"] == "redis://:s3cret@redis:6379/0"
        assert config[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_models_are_mounted_read_only_and_outputs_writable(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-models"
    config = services(tmp_path, "--profile", "gpu", MODEL_DIR=str(model_dir))
    for name in ("worker-cpu", "worker-gpu", "watcher"):
        assert f"{model_dir}:/models:ro" in _volumes(config[name]), name
        assert config[name]["environment"]["VOXMILL_MODEL_DIR"] == "/models"
    for name in ("worker-cpu", "worker-gpu"):
        assert any(v.endswith(":/data:rw") or v.endswith(":/data") for v in _volumes(config[name]))


def test_cpu_workers_and_the_watcher_share_the_optimized_model_cache(tmp_path: Path) -> None:
    config = services(tmp_path)
    for name in ("worker-cpu", "watcher"):
        assert config[name]["environment"]["VOXMILL_MODEL_CACHE_DIR"] == "/cache/ort"
        assert any(v.startswith("ort-cache:/cache/ort") for v in _volumes(config[name])), name
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        assert "chmod 700 /cache/ort" in (ROOT / dockerfile).read_text()  # the cache refuses shared folders


def test_cpu_workers_serve_embed_with_replicas_and_a_healthcheck(tmp_path: Path) -> None:
    cpu = services(tmp_path)["worker-cpu"]
    assert cpu["command"] == ["worker", "-Q", "embed"]
    assert cpu["deploy"]["replicas"] == 2
    assert "inspect ping" in " ".join(cpu["healthcheck"]["test"])
    assert cpu["environment"]["VOXMILL_PROVIDER"] == "cpu"
    assert services(tmp_path, CPU_WORKERS="6")["worker-cpu"]["deploy"]["replicas"] == 6


def test_gpu_worker_is_a_solo_tokenize_worker_with_an_nvidia_reservation(tmp_path: Path) -> None:
    gpu = services(tmp_path, "--profile", "gpu")["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["command"] == ["worker", "-Q", "tokenize", "--pool", "solo"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["build"]["dockerfile"] == "Dockerfile.gpu"
    assert "inspect ping" in " ".join(gpu["healthcheck"]["test"])
    assert any(v.endswith(":/cache/engines:rw") for v in _volumes(gpu))  # engines survive restarts


def test_flower_watches_the_same_broker_on_5555(tmp_path: Path) -> None:
    flower = services(tmp_path)["flower"]
    assert flower["entrypoint"][:4] == ["celery", "-A", "workers.app", "flower"]
    assert flower["build"]["args"]["EXTRAS"] == "monitor"
    assert "127.0.0.1:5555:5555" in _ports(flower)
    assert flower["environment"]["FLOWER_BASIC_AUTH"] == "ops:pw"  # its API answers a login, not anyone


def test_dockerfiles_and_dockerignore_exist() -> None:
    cpu = (ROOT / "Dockerfile").read_text()
    gpu = (ROOT / "Dockerfile.gpu").read_text()
    assert "USER voxmill" in cpu and 'ENTRYPOINT ["voxmill"]' in cpu
    assert "FROM nvidia/cuda:" in gpu and "cudnn-runtime" in gpu and '".[${EXTRAS}]"' in gpu
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored and "models" in ignored


def _volumes(service: dict[str, Any]) -> list[str]:
    """Volumes as `source:target[:mode]` strings, whichever syntax docker-compose printed."""
    result = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            result.append(volume)
        else:
            mode = "ro" if volume.get("read_only") else "rw"
            result.append(f"{volume['source']}:{volume['target']}:{mode}")
    return result


def _ports(service: dict[str, Any]) -> list[str]:
    """Published ports as `host_ip:published:target`, whichever syntax docker-compose printed."""
    result = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            result.append(f"{port.get('host_ip', '')}:{port['published']}:{port['target']}")
        else:
            result.append(str(port).split("/")[0])
    return result
