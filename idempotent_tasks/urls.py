"""Showing a store's or database's URL without its secrets."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

#: Query parameters that hold a secret in redis-py's, SQLAlchemy's and the drivers' URLs.
SECRET_PARAMETERS = frozenset(
    {"password", "passwd", "pass", "sslpassword", "ssl_password", "token", "secret"}
)


def shown_url(url: str) -> str:
    """``url`` with its password, and any query parameter holding a secret, as ``***`` (each
    one of a Sentinel backend's ``;``-separated URLs)."""
    if not url.startswith("sentinel"):
        return _shown(url)
    return ";".join(_shown(part) for part in url.split(";"))


#: A URL's password: after the user name, up to an ``@``. SQLAlchemy reads it up to the first
#: one, redis-py up to the last of the host part, and either may hold ``/``, ``?``, ``#`` or
#: ``;``, which ``urlsplit`` would take for the URL's own: everything up to the last ``@`` is
#: hidden (more than the password, at worst). A scheme misspelt (``postgresql//``,
#: ``postgresql:/``: the URL then refused for it) still has its password hidden.
_PASSWORD = re.compile(r"^(?P<head>[^/@]*/+[^:/@]*:).*@")


def _shown(url: str) -> str:
    """One URL shown; left exactly as it is when it holds no secret (``urlunsplit`` would
    respell ``sqlite:////abs/path`` and ``memory://``)."""
    url = _PASSWORD.sub(r"\g<head>***@", url, count=1)
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if not any(name.lower() in SECRET_PARAMETERS for name, _ in pairs):
        return url
    hidden = [
        (name, "***" if name.lower() in SECRET_PARAMETERS else value) for name, value in pairs
    ]
    return urlunsplit(parts._replace(query=urlencode(hidden, safe="*")))


def url_text(url: object) -> str:
    """A store's or database's URL setting as text: an SQLAlchemy ``URL`` with its password
    (``str()`` of one puts ``***`` in its place); anything else as ``str()`` gives it."""
    render = getattr(url, "render_as_string", None)
    if callable(render):
        return str(render(hide_password=False))
    return str(url)  # text, or a URL type of its own whose str() is the URL (pydantic, yarl)
