"""The storage layer's pure parts: URLs, the URL jail, roots in the settings, braces, retries."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import BAD_REQUEST, FORBIDDEN_PATH, NOT_FOUND, STORE_ERROR, VoxmillError
from pipeline.settings import Settings
from pipeline.storage import locations, objects, urls
from pipeline.storage.paths import ConfinedPath, resolve_allowed
from pipeline.storage.urls import check_url, expand_braces, parse_url, split_roots, url_within


def test_urls_are_normalised_dot_segments_removed_and_never_climb_above_the_bucket() -> None:
    assert str(parse_url("s3://bkt/a/./b/../c.wav")) == "s3://bkt/a/c.wav"
    assert str(parse_url("s3://bkt/../../etc/passwd")) == "s3://bkt/etc/passwd"
    assert str(parse_url("GCS://bkt//x")) == "gs://bkt/x"
    assert str(parse_url("https://Host:8443/p/q?x=1")) == "https://host:8443/p/q"
    assert not urls.is_url(Path("s3://bkt/a"))  # a Path is never a URL
    assert not urls.is_url("/data/s3://x")


def test_a_url_with_credentials_is_refused_without_echoing_them() -> None:
    with pytest.raises(VoxmillError) as caught:
        parse_url("s3://AKIAEXAMPLE:supersecret@bkt/a.wav")
    assert caught.value.code == BAD_REQUEST
    assert "supersecret" not in caught.value.message and "AKIAEXAMPLE" not in caught.value.message
    assert "credentials" in caught.value.message


def test_the_url_jail_compares_scheme_bucket_and_prefix_on_a_segment_boundary() -> None:
    root = parse_url("s3://bkt/corpus")
    assert url_within(parse_url("s3://bkt/corpus/a.wav"), root)
    assert url_within(parse_url("s3://bkt/corpus"), root)
    assert not url_within(parse_url("s3://bkt/corpus2/a.wav"), root)  # not a segment boundary
    assert not url_within(parse_url("s3://bkt2/corpus/a.wav"), root)
    assert not url_within(parse_url("gs://bkt/corpus/a.wav"), root)
    assert not url_within(parse_url("s3://bkt/corpus/../secret/a.wav"), root)
    assert url_within(parse_url("s3://bkt/anything"), parse_url("s3://bkt"))


def test_check_url_forbids_outside_the_prefixes_and_names_the_setting() -> None:
    assert check_url("s3://bkt/corpus/x/../a.wav", ["s3://bkt/corpus"]) == "s3://bkt/corpus/a.wav"
    with pytest.raises(VoxmillError) as caught:
        check_url("s3://bkt/corpus/../private/a.wav", ["s3://bkt/corpus"])
    assert caught.value.code == FORBIDDEN_PATH
    assert "VOXMILL_ALLOWED_ROOTS" in caught.value.message
    with pytest.raises(VoxmillError) as none:
        check_url("s3://bkt/a.wav", [])
    assert none.value.code == FORBIDDEN_PATH


def test_resolve_allowed_sends_urls_to_the_url_jail_and_paths_to_the_path_jail(tmp_path: Path) -> None:
    assert resolve_allowed("s3://bkt/c/a.wav", [tmp_path], ["s3://bkt/c"]) == "s3://bkt/c/a.wav"
    local = resolve_allowed(str(tmp_path / "a.wav"), [tmp_path], [])
    assert local == ConfinedPath((tmp_path / "a.wav").resolve(), str(tmp_path.resolve()))
    with pytest.raises(VoxmillError) as caught:
        resolve_allowed("s3://bkt/c/a.wav", [tmp_path], [])
    assert caught.value.code == FORBIDDEN_PATH
    with pytest.raises(VoxmillError) as creds:
        resolve_allowed("s3://k:s@bkt/c/a.wav", [tmp_path], ["s3://bkt"])
    assert creds.value.code == BAD_REQUEST


def test_allowed_roots_split_keeping_urls_whole_and_travel_to_child_processes() -> None:
    assert split_roots("/data:s3://bkt/p:https://host:8443/x:/c") == [
        "/data",
        "s3://bkt/p",
        "https://host:8443/x",
        "/c",
    ]
    settings = Settings.load({"VOXMILL_ALLOWED_ROOTS": "/data:s3://bkt/p"}, path=Path("/nonexistent.yaml"))
    assert settings.allowed_roots == (Path("/data"),)
    assert settings.allowed_url_roots == ("s3://bkt/p",)
    again = Settings.load(settings.to_env(), path=Path("/nonexistent.yaml"))
    assert again.allowed_roots == settings.allowed_roots
    assert again.allowed_url_roots == settings.allowed_url_roots


def test_only_url_roots_allow_no_local_path() -> None:
    assert Settings(allowed_roots=("s3://bkt",)).roots() == ()
    assert Settings().roots() == (Path.cwd().resolve(),)


def test_brace_patterns_expand_as_webdataset_does() -> None:
    assert expand_braces("s3://b/shards/{000..003}.tar") == [f"s3://b/shards/{n:03d}.tar" for n in range(4)]
    assert expand_braces("x-{a,b}-{1..2}.tar") == ["x-a-1.tar", "x-a-2.tar", "x-b-1.tar", "x-b-2.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"]
    with pytest.raises(VoxmillError):
        expand_braces("x-{1..2.tar")


def test_failures_are_classified_missing_refused_or_transient_and_retried_a_bounded_number_of_times() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "bytes"

    assert objects.with_retries(flaky, "s3://b/k", "cannot read", base_s=0.0) == "bytes"
    assert len(calls) == 3

    def down() -> str:
        calls.append(1)
        raise TimeoutError("timed out")

    calls.clear()
    with pytest.raises(VoxmillError) as caught:
        objects.with_retries(down, "s3://b/k", "cannot read", base_s=0.0)
    assert caught.value.code == STORE_ERROR and len(calls) == objects.RETRY_ATTEMPTS
    assert "s3://b/k" in caught.value.message and "TimeoutError" in caught.value.message

    def missing() -> str:
        calls.append(1)
        raise FileNotFoundError("b/k")

    calls.clear()
    with pytest.raises(VoxmillError) as gone:
        objects.with_retries(missing, "s3://b/k", "cannot read", base_s=0.0)
    assert gone.value.code == NOT_FOUND and len(calls) == 1  # not retried

    def refused() -> str:
        raise PermissionError("Access Denied for key AKIAEXAMPLE")

    with pytest.raises(VoxmillError) as denied:
        objects.with_retries(refused, "s3://b/k", "cannot read", base_s=0.0)
    assert denied.value.code == STORE_ERROR
    assert "AKIAEXAMPLE" not in denied.value.message  # the client's own text is never repeated


def test_output_locations_local_and_object(tmp_path: Path) -> None:
    local = locations.output_location(tmp_path)
    assert local.is_local and local.ref("shards/a.parquet") == tmp_path / "shards" / "a.parquet"
    with local.writer("shards/a.parquet") as stream:
        stream.write(b"data")
    assert local.names("shards") == {"a.parquet"} and local.read_bytes("shards/a.parquet") == b"data"
    assert local.names("nothing") == set()
    remote = locations.output_location("s3://bkt/run/../runs/1/")
    assert not remote.is_local and remote.ref("shards/a.parquet") == "s3://bkt/runs/1/shards/a.parquet"
    with pytest.raises(VoxmillError) as caught:
        locations.output_location("https://host/out")
    assert caught.value.code == BAD_REQUEST


def test_a_job_path_that_is_a_url_is_jailed_to_the_url_prefixes() -> None:
    from workers.queue.tasks import decode_job

    assert decode_job({"path": "s3://bkt/c/./a.wav"}, (), ("s3://bkt/c",)) == (
        "s3://bkt/c/./a.wav",
        "s3://bkt/c/a.wav",
    )
    with pytest.raises(VoxmillError) as outside:
        decode_job({"path": "s3://bkt/other/a.wav"}, (), ("s3://bkt/c",))
    assert outside.value.code == FORBIDDEN_PATH
    with pytest.raises(VoxmillError) as creds:
        decode_job({"path": "https://u:p@host/a.wav"}, (), ("https://host",))
    assert creds.value.code == BAD_REQUEST and "u:p" not in creds.value.message


# --------------------------------------------------------------------------- URL spellings that escape


ROOT = "http://h/corpus"
HIDDEN_SPELLINGS = [
    "http://h/corpus/%2e%2e/secret/x.wav",
    "http://h/corpus/%2E%2E/secret/x.wav",
    "http://h/corpus/.%2e/secret/x.wav",
    "http://h/corpus/..%2fsecret/x.wav",
    "http://h/corpus/..%2Fsecret/x.wav",
    "http://h/corpus/..%5csecret/x.wav",
    "http://h/corpus/%252e%252e/secret/x.wav",  # decoded twice by some stacks
    "http://h/corpus/..%3b/secret/x.wav",
    "http://h/corpus/x%00/../../secret/x.wav",
    "http://h/corpus/%c0%ae%c0%ae/secret/x.wav",  # overlong UTF-8 '.'
    "http://h/corpus/..;/secret/x.wav",  # servlet containers drop ';...' and climb
    "http://h/corpus/..;x=1/secret/x.wav",
    "http://h/corpus/.;/x.wav",
    "http://h/corpus/..\\secret/x.wav",
    "https://h/corpus/a%2fb.wav",
    "s3://bkt/corpus/%2e%2e/secret/x.wav",  # the same rule whatever the store
    "gs://bkt/corpus/..;/secret/x.wav",
]


@pytest.mark.parametrize("url", HIDDEN_SPELLINGS)
def test_a_url_whose_path_a_server_could_read_as_other_segments_is_refused(url: str) -> None:
    with pytest.raises(VoxmillError) as caught:
        check_url(url, [ROOT, "s3://bkt/corpus", "gs://bkt/corpus"])
    assert caught.value.code == BAD_REQUEST
    assert (
        "escape" in caught.value.message
        or "segment" in caught.value.message
        or "backslash" in caught.value.message
    )


@pytest.mark.parametrize(
    ("url", "checked"),
    [
        ("http://h/corpus/x/../a.wav", "http://h/corpus/a.wav"),
        ("http://H/corpus/./sub//a.wav?sig=1#t", "http://h/corpus/sub/a.wav"),
        ("http://h/corpus/caf%C3%A9%20no%C3%ABl.wav", "http://h/corpus/caf%C3%A9%20no%C3%ABl.wav"),
        ("http://h/corpus/a;v=1.wav", "http://h/corpus/a;v=1.wav"),  # ';' in a name is a name
        ("http://h/corpus/100%.wav", "http://h/corpus/100%.wav"),  # not an escape: a '%' that stays one
        ("s3://bkt/corpus/dir\\a.wav", "s3://bkt/corpus/dir\\a.wav"),  # a key may hold a backslash
    ],
)
def test_plain_spellings_are_normalised_and_stay_inside(url: str, checked: str) -> None:
    assert check_url(url, [ROOT, "s3://bkt/corpus"]) == checked


@pytest.mark.parametrize(
    "url",
    ["http://h/corpus/../secret/x.wav", "http://h/corpus/a/../../secret/x.wav", "http://h/corpus2/x.wav"],
)
def test_plain_dot_segments_are_removed_before_the_root_check(url: str) -> None:
    with pytest.raises(VoxmillError) as caught:
        check_url(url, [ROOT])
    assert caught.value.code == FORBIDDEN_PATH


def test_what_is_fetched_is_what_was_checked() -> None:
    """The URL the HTTP client sends (yarl, as fsspec builds it) names the checked segments."""
    import yarl

    for url in ["http://h/corpus/a b/./c%41.wav", "http://h/corpus/x/../y/%7Ez.wav"]:
        checked = check_url(url, [ROOT])
        assert urls.parse_url(checked) == urls.parse_url(url)  # parsing again changes nothing
        sent = yarl.URL(checked)
        assert sent.path.startswith("/corpus/") and "/../" not in sent.path
        assert sent.path == "/" + urls.parse_url(checked).key.replace("%41", "A").replace("%7E", "~")


def test_urls_over_the_length_limit_are_refused_before_parsing() -> None:
    url = "http://h/corpus/" + "a/" * 3_000_000
    for call in (
        lambda: urls.parse_url(url),
        lambda: check_url(url, [ROOT]),
        lambda: resolve_allowed(url, []),
    ):
        with pytest.raises(VoxmillError) as caught:
            call()
        assert caught.value.code == BAD_REQUEST
        assert (
            caught.value.message == f"URL is {len(url)} characters long; the limit is 4096 (max_text_chars)"
        )
    assert check_url("http://h/corpus/a.wav", [ROOT], max_chars=21) == "http://h/corpus/a.wav"
    with pytest.raises(VoxmillError):
        check_url("http://h/corpus/a.wav", [ROOT], max_chars=20)


def test_a_failure_wrapping_a_voxmill_error_is_that_error() -> None:
    """fsspec's HTTP `info` turns every failure into FileNotFoundError; a refused redirect inside
    it stays a refused redirect, not `not_found`."""
    refused = VoxmillError(
        FORBIDDEN_PATH, "http://h/corpus/a.wav answered 302 (a redirect); redirects are refused"
    )
    try:
        try:
            raise refused
        except VoxmillError as exc:
            raise FileNotFoundError("http://h/corpus/a.wav") from exc
    except FileNotFoundError as wrapped:
        assert objects.store_failure(wrapped, "http://h/corpus/a.wav", "cannot stat") is refused

    def info() -> None:
        raise FileNotFoundError("x") from refused

    with pytest.raises(VoxmillError) as caught:
        objects.with_retries(info, "http://h/corpus/a.wav", "cannot stat", base_s=0.0)
    assert caught.value is refused


# --------------------------------------------------------------------------- string budgets of a job


@pytest.mark.parametrize("field", ["path", "name"])
def test_every_string_of_a_job_is_bounded_before_it_is_used(field: str, tmp_path: Path) -> None:
    from workers.queue.tasks import decode_job, job_label

    huge = "a/" * 5_000_000
    job = {"path": huge} if field == "path" else {"audio": b"RIFF", "name": huge}
    with pytest.raises(VoxmillError) as caught:
        decode_job(job, [tmp_path], (), 4096)
    assert caught.value.code == BAD_REQUEST
    assert (
        caught.value.message
        == f"'{field}' is {len(huge)} characters long; the limit is 4096 (max_text_chars)"
    )
    label = job_label(job, 4096)
    assert len(label) < 4200 and label.endswith(f"... ({len(huge)} characters)")
    url_job = {"path": "https://h/corpus/" + "x" * 5000}
    with pytest.raises(VoxmillError) as url:
        decode_job(url_job, [tmp_path], ("https://h/corpus",), 4096)
    assert url.value.code == BAD_REQUEST and "the limit is 4096" in url.value.message
    assert decode_job({"audio": b"RIFF", "name": "n" * 4096}, [tmp_path], (), 4096) == ("n" * 4096, b"RIFF")


def test_an_http_server_that_fails_is_retried_and_only_a_404_is_not_found() -> None:
    """fsspec turns any failed HEAD-then-GET into FileNotFoundError: a 5xx is still retried and
    said as `store_error`, a 404 is `not_found` (a real HTTP server on loopback)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    failures = {"/flaky.wav": 2, "/down.wav": 10**6}
    served: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self.answer()

        def do_GET(self) -> None:
            self.answer()

        def answer(self) -> None:
            served.append(self.path)
            if self.path not in failures:
                self.send_error(404)
            elif failures[self.path] > 0:
                failures[self.path] -= 1
                self.send_error(503)
            else:
                self.send_response(200)
                self.send_header("Content-Length", "4")
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(b"RIFF")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert objects.url_size(f"{base}/flaky.wav") == 4  # two 503s (HEAD and GET), then an answer
        with pytest.raises(VoxmillError) as down:
            objects.url_size(f"{base}/down.wav")
        assert down.value.code == STORE_ERROR and served.count("/down.wav") == 2 * objects.RETRY_ATTEMPTS
        with pytest.raises(VoxmillError) as missing:
            objects.url_size(f"{base}/gone.wav")
        assert missing.value.code == NOT_FOUND and served.count("/gone.wav") == 2  # HEAD, GET: no retry
    finally:
        server.shutdown()
        server.server_close()
