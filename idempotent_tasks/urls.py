"""Showing a store's or database's URL without its secrets."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

#: Query parameters that hold a secret in redis-py's, SQLAlchemy's and the drivers' URLs.
SECRET_PARAMETERS = frozenset(
    {"password", "passwd", "pass", "sslpassword", "ssl_password", "token", "secret"}
)


def shown_url(url: str) -> str:
    """``url`` with its password, and any query parameter holding a secret, as ``***`` (each
    one of a Sentinel backend's ``;``-separated URLs)."""
    return ";".join(_shown(part) for part in url.split(";"))


def _shown(url: str) -> str:
    """One URL shown; left exactly as it is when it holds no secret (``urlunsplit`` would
    respell ``sqlite:////abs/path`` and ``memory://``)."""
    parts = urlsplit(url)
    netloc, query = parts.netloc, parts.query
    if parts.password is not None:
        credentials, _, host = netloc.rpartition("@")
        netloc = f"{credentials.partition(':')[0]}:***@{host}"
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(name.lower() in SECRET_PARAMETERS for name, _ in pairs):
        hidden = [
            (name, "***" if name.lower() in SECRET_PARAMETERS else value) for name, value in pairs
        ]
        query = urlencode(hidden, safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))
