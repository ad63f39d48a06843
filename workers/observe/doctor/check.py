"""One line of `voxmill doctor`'s report, and what the checks share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "warning", "error"]


@dataclass(frozen=True)
class Check:
    """One line of the report: what was looked at, how it is, and what to do about it."""

    name: str
    status: Status
    detail: str
    fix: str = ""


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def warning(name: str, detail: str, fix: str) -> Check:
    return Check(name, "warning", detail, fix)


def error(name: str, detail: str, fix: str) -> Check:
    return Check(name, "error", detail, fix)
