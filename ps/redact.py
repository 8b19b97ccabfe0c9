"""Store addresses with their secrets taken out, for anything that is written or shown.

A store URL may carry a password: ``redis://user:password@host:6379/0`` (redis-py also
reads ``?password=...``). Whatever records or prints a URL (a job's config in its
metrics file and checkpoints, a log line, an error message) takes it through
:func:`redact_url` first, which keeps everything a reader needs to recognise the store
(scheme, user, host, port, database, other options) and replaces the password with
``***``. Text that holds no such URL comes back unchanged, so any string may be passed.
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://user:password@  ->  the password is what lies between the first ':' after the
# user and the last '@' before the host (a password may itself hold '@' or ':')
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*:)(?P<secret>[^\s/]*)@")
# ?password=...&  (and &password=..., any letter case)
_QUERY = re.compile(r"(?P<head>[?&](?:password|passwd|pwd)=)(?P<secret>[^&\s#]*)", re.IGNORECASE)


def redact_url(text: str) -> str:
    """``text`` with every URL password replaced by ``***``:
    ``redis://default:***@host:6379/0``, ``redis://host:6379/0?password=***``."""
    text = _USERINFO.sub(lambda m: f"{m['head']}{MASK}@", text)
    return _QUERY.sub(lambda m: f"{m['head']}{MASK}", text)


def redact_values(value: object) -> object:
    """``value`` (a JSON-able config: dicts, lists, strings, numbers) with every string
    taken through :func:`redact_url`."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: redact_values(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_values(v) for v in value]
    return value
