"""Secrets kept out of what voxmill prints: the password of a URL, in a URL or in any text."""

from __future__ import annotations

import re

# What `(\w+://[^:/@\s]*:)[^@\s]+@` matches, as runs read from fixed places (`redact`).
USER_RUN = re.compile(r"[^:/@\s]*")
PASSWORD_RUN = re.compile(r"[^@\s]*")


def redact(text: str) -> str:
    """Replace the password of any `scheme://user:password@` in `text` by `***`.

    One pass: the pattern above as one regex backtracks from every start (40k characters of
    `a://b:` took 1.9 s); here a password run that met no '@' is never read again.
    """
    parts: list[str] = []
    copied = 0  # text[:copied] is in parts
    no_at_before = 0  # a password run starting before this meets whitespace or the end, not '@'
    found = text.find("://")
    while found != -1:
        if found > copied and (text[found - 1].isalnum() or text[found - 1] == "_"):
            user_end = USER_RUN.match(text, found + 3).end()  # type: ignore[union-attr]
            if text.startswith(":", user_end) and user_end + 1 >= no_at_before:
                end = PASSWORD_RUN.match(text, user_end + 1).end()  # type: ignore[union-attr]
                if text.startswith("@", end) and end > user_end + 1:
                    parts += [text[copied : user_end + 1], "***@"]
                    copied = end + 1
                    found = text.find("://", copied)
                    continue
                no_at_before = end
        found = text.find("://", found + 1)
    return "".join([*parts, text[copied:]]) if parts else text


def redact_url(url: str | None) -> str | None:
    """Hide the password of a `scheme://user:password@host/...` URL."""
    if not url or "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"
