"""Signed S3 GETs without the SDK (`pipeline.storage.s3_get`): the same signature botocore makes
for the same request, and used only where botocore would ask the store the same way. Reading
real objects through it is tested against a real S3 API in tests/integration/test_object_storage.py."""

from __future__ import annotations

import datetime
import urllib.parse

import pytest
from botocore import auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from pipeline.storage.s3_get import EMPTY_SHA256, DirectS3, Endpoint, plain_bucket

NOW = datetime.datetime(2026, 12, 6, 3, 4, 5, tzinfo=datetime.timezone.utc)


def _botocore_authorization(
    credentials: Credentials, endpoint: Endpoint, path: str, monkeypatch: pytest.MonkeyPatch
) -> str:
    monkeypatch.setattr(auth, "get_current_datetime", lambda *a, **k: NOW.replace(tzinfo=None))
    url = f"{endpoint.scheme}://{endpoint.host_header}{path}"
    request = AWSRequest(method="GET", url=url, headers={"X-Amz-Content-SHA256": EMPTY_SHA256})
    auth.S3SigV4Auth(credentials, "s3", endpoint.region).add_auth(request)
    return str(request.headers["Authorization"])


@pytest.mark.parametrize(
    "key",
    ["clip.wav", "spk 1/utt+2=3.flac", "dir/ünï cödé/a~b_c-d.e.wav", "a%20b/(x)!*'.ogg", "deep/er/key"],
)
@pytest.mark.parametrize("token", [None, "session-token/abc=="])
@pytest.mark.parametrize(
    "endpoint",
    [
        Endpoint("http", "127.0.0.1", 9000, "us-east-1"),
        Endpoint("https", "s3.eu-west-1.amazonaws.com", None, "eu-west-1"),
    ],
)
def test_the_signature_is_botocores_for_the_same_request(
    key: str, token: str | None, endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    direct = DirectS3(endpoint, credentials)
    path = "/" + urllib.parse.quote(f"my-bucket/{key}", safe="/~")
    headers = direct._signed_headers(path, NOW)
    assert headers["authorization"] == _botocore_authorization(credentials, endpoint, path, monkeypatch)
    assert headers.get("x-amz-security-token") == token
    assert headers["host"] == endpoint.host_header


def test_the_signing_key_is_derived_once_a_day() -> None:
    direct = DirectS3(Endpoint("http", "127.0.0.1", 9000, "us-east-1"), Credentials("a", "s"))
    direct._signed_headers("/b/k", NOW)
    first = direct._keys
    direct._signed_headers("/b/k", NOW + datetime.timedelta(hours=1))
    assert direct._keys is first  # the same day: the same key, not derived again
    direct._signed_headers("/b/k", NOW + datetime.timedelta(days=1))
    assert len(direct._keys) == 1 and direct._keys is not first  # yesterday's is dropped


def test_it_is_used_only_where_botocore_would_ask_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    direct = DirectS3.from_environment()
    assert direct is not None
    assert direct.endpoint == Endpoint("http", "127.0.0.1", 9000, "eu-west-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    aws = DirectS3.from_environment()
    assert aws is not None and aws.endpoint == Endpoint(
        "https", "s3.eu-west-1.amazonaws.com", None, "eu-west-1"
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000/under/a/path")
    assert DirectS3.from_environment() is None  # an endpoint with a path: the SDK knows what it means
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert DirectS3.from_environment() is None  # behind a proxy: the SDK's connections


@pytest.mark.parametrize(
    ("bucket", "plain"),
    [
        ("corpus", True),
        ("my.bucket-1", True),
        ("UPPER", False),
        ("a", False),
        ("x" * 64, False),
        ("a_b", False),
    ],
)
def test_only_plain_bucket_names_are_read_path_style(bucket: str, plain: bool) -> None:
    assert plain_bucket(bucket) is plain
