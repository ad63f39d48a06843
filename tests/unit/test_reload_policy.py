"""The reload policy, without Redis or worker processes: what a worker process does in a round."""

from __future__ import annotations

import math

from pipeline.models.identity import FileIdentity
from workers.reload.policy import (
    Adopt,
    AwaitVerdict,
    Candidate,
    Load,
    Published,
    Refuse,
    ReloadFailure,
    ReloadView,
    RoleState,
    after_failure,
    decide,
    local_mismatch,
    retry_due,
    slot_count,
)

FILE = FileIdentity("/m/campplus.onnx", device=1, inode=2, size=1000, mtime_ns=3, ctime_ns=3)
CHANGED = FileIdentity("/m/campplus.onnx", device=1, inode=9, size=1000, mtime_ns=4, ctime_ns=4)
OLD, NEW = "a" * 64, "b" * 64
PUBLISHED = Published(NEW, generation=2, size=1000)
NOW = 100.0


def view(*roles: RoleState, peers: int = 2, aside_min_bytes: float = 500) -> ReloadView:
    return ReloadView(
        roles=roles, peers={r.role: peers for r in roles}, aside_min_bytes=aside_min_bytes, now=NOW
    )


def embedder(**changes: object) -> RoleState:
    values: dict[str, object] = {
        "role": "embedder",
        "serving": OLD,
        "published": PUBLISHED,
        "candidate": None,
        "local": FILE,
        "failure": None,
    }
    values.update(changes)
    return RoleState(**values)  # type: ignore[arg-type]


def refusal(reason: str = "differs") -> Refuse:
    return Refuse("embedder", NEW, 2, FILE, reason)


def failed_load() -> Load:
    return Load("embedder", FILE, NEW, 2, NEW, stand_aside=False)


# -- what a round does ---------------------------------------------------------------------------
def test_a_new_generation_is_loaded_beside_serving_with_its_sha256_expected() -> None:
    assert decide(view(embedder(), aside_min_bytes=2000)) == [Load("embedder", FILE, NEW, 2, NEW, False)]
    assert decide(view(embedder())) == [Load("embedder", FILE, NEW, 2, NEW, True)]  # large: stands aside


def test_the_generation_already_served_is_adopted() -> None:
    assert decide(view(embedder(serving=NEW))) == [Adopt("embedder", 2)]


def test_nothing_published_leaves_a_serving_process_alone() -> None:
    assert decide(view(embedder(published=None))) == []


def test_a_process_holding_nothing_takes_its_own_file_published_or_not() -> None:
    other_size = Published(NEW, 2, size=999)
    assert decide(view(embedder(serving=None, published=other_size))) == [
        Load("embedder", FILE, NEW, 2, None, True)
    ]
    assert decide(view(embedder(serving=None, published=None))) == [Load("embedder", FILE, "", 0, None, True)]


def test_a_local_copy_of_another_size_is_refused_without_reading_it() -> None:
    reason = "this machine's campplus.onnx has 1000 bytes, the published file 999"
    assert decide(view(embedder(published=Published(NEW, 2, size=999)))) == [
        Refuse("embedder", NEW, 2, FILE, reason)
    ]
    missing = Refuse("embedder", NEW, 2, None, "this machine has no such model file")
    assert decide(view(embedder(local=None))) == [missing]


def test_a_candidate_under_validation_is_awaited_standing_aside_for_a_large_model() -> None:
    large, small = Candidate("c" * 64, 2000), Candidate("c" * 64, 100)
    assert decide(view(embedder(serving=NEW, candidate=large))) == [
        Adopt("embedder", 2),
        AwaitVerdict("embedder", True),
    ]
    assert decide(view(embedder(serving=NEW, candidate=small))) == [
        Adopt("embedder", 2),
        AwaitVerdict("embedder", False),
    ]


def test_a_candidate_whose_sha256_is_not_known_yet_counts_as_new() -> None:
    assert AwaitVerdict("embedder", True) in decide(
        view(embedder(serving=NEW, candidate=Candidate("", 2000)))
    )


def test_the_served_file_announced_again_is_no_candidate() -> None:
    assert decide(view(embedder(serving=NEW, candidate=Candidate(NEW, 2000)))) == [Adopt("embedder", 2)]


def test_a_lone_process_never_stands_aside() -> None:
    steps = decide(view(embedder(serving=NEW, candidate=Candidate("c" * 64, 2000)), peers=1))
    assert AwaitVerdict("embedder", False) in steps
    assert decide(view(embedder(), peers=1)) == [Load("embedder", FILE, NEW, 2, NEW, False)]


def test_a_process_stands_aside_only_when_every_role_it_serves_has_another_process() -> None:
    tokenizer = RoleState("tokenizer", "t" * 64, Published("t" * 64, 1, 10), None, FILE)
    state = ReloadView((embedder(), tokenizer), {"embedder": 2, "tokenizer": 1}, 500, NOW)
    assert decide(state)[0] == Load("embedder", FILE, NEW, 2, NEW, stand_aside=False)


def test_a_verdict_published_while_awaited_is_loaded_in_the_same_round() -> None:
    steps = decide(view(embedder(candidate=Candidate(NEW, 2000))))
    assert steps == [AwaitVerdict("embedder", True), Load("embedder", FILE, NEW, 2, NEW, True)]


# -- failures and retries ------------------------------------------------------------------------
def test_a_failed_load_is_retried_with_growing_backoff() -> None:
    first = after_failure(None, failed_load(), "out of memory", NOW, 1e9, retry_max_s=60)
    assert first.attempts == 1 and first.retry_at == NOW + 2
    assert not retry_due(first, NEW, FILE, NOW + 1) and retry_due(first, NEW, FILE, NOW + 2)
    second = after_failure(first, failed_load(), "out of memory", NOW, 1e9, retry_max_s=60)
    assert second.attempts == 2 and second.retry_at == NOW + 4
    assert decide(view(embedder(failure=second))) == []


def test_the_backoff_is_capped() -> None:
    failure: ReloadFailure | None = None
    for _ in range(12):
        failure = after_failure(failure, failed_load(), "out of memory", NOW, 1e9, retry_max_s=60)
    assert failure is not None and failure.retry_at == NOW + 60


def test_a_refused_file_waits_until_it_changes_or_a_new_generation_comes() -> None:
    failure = after_failure(None, refusal(), "differs", NOW, 1e9, retry_max_s=60)
    assert math.isinf(failure.retry_at)
    assert not retry_due(failure, NEW, FILE, NOW + 1e6)
    assert retry_due(failure, NEW, CHANGED, NOW) and retry_due(failure, "c" * 64, FILE, NOW)
    assert decide(view(embedder(failure=failure))) == []
    assert decide(view(embedder(failure=failure, local=CHANGED), aside_min_bytes=2000)) == [
        Load("embedder", CHANGED, NEW, 2, NEW, False)
    ]


def test_failures_are_reported_as_people_read_them() -> None:
    reported = after_failure(None, failed_load(), "out of memory", NOW, 1234.5678, retry_max_s=60).to_dict()
    assert reported == {
        "sha256": NEW,
        "generation": 2,
        "reason": "out of memory",
        "attempts": 1,
        "time": 1234.568,
    }


def test_a_local_copy_of_another_size_is_not_the_published_file() -> None:
    assert "1000 bytes, the published file 999" in local_mismatch(FILE, Published(NEW, 2, size=999))
    assert local_mismatch(FILE, Published(NEW, 2, size=1000)) == ""
    assert local_mismatch(FILE, None) == ""
    assert "no such model file" in local_mismatch(None, PUBLISHED)


def test_published_records_from_redis() -> None:
    assert Published.from_record({}) is None
    assert Published.from_record({"sha256": NEW, "generation": "3", "size": "7"}) == Published(NEW, 3, 7)
    assert Published.from_record({"sha256": NEW}) == Published(NEW, 0, None)


def test_reload_slots_are_half_the_machine_unless_set() -> None:
    assert slot_count(0, peers=4) == 2 and slot_count(0, peers=1) == 1 and slot_count(3, peers=8) == 3
