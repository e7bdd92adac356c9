"""How the CLI authenticates to a Ray cluster, and what it says when the cluster refuses it.

`ray start --head` turns token authentication on by itself when a token exists on the machine
(`~/.ray/auth_token`, written by `ray get-auth-token --generate` or by any earlier local
`ray.init()`), but a client process stays in mode "disabled" unless RAY_AUTH_MODE=token is set,
so its requests carry no token and are refused. Like `ray.init()` does for a local cluster, the
CLI therefore turns token mode on whenever it finds a token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH,
~/.ray/auth_token); a cluster without authentication ignores the token. RAY_AUTH_MODE, when set,
is respected as it is.

A refused connection becomes one line naming the cause (no token found, or the wrong one) and the
fix; the C++ core's own log of each refused handshake (one line a second while it retries) is
kept out of the output.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from pathlib import Path

# What the C++ core prints while the GCS refuses it; everything else it prints is passed on.
_REFUSED = re.compile(r"gcs_client\.cc.*(InvalidAuthToken|Unauthenticated)")
GET_TOKEN = "`ray get-auth-token` on the head prints the cluster's token"


def token_source() -> str | None:
    """Where Ray takes this process's token from, in Ray's order of precedence; None if nowhere."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def use_token_if_available() -> None:
    """Token mode for this process when RAY_AUTH_MODE is unset and a token exists (Ray's own rule
    for local clusters, applied to every address)."""
    from ray._private.authentication import authentication_token_setup as setup

    quiet = logging.getLogger(setup.__name__)          # its "token authentication is enabled" notice
    level, quiet.level = quiet.level, logging.ERROR
    try:
        setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        quiet.setLevel(level)


class AuthRefused(ConnectionError):
    """The cluster refused this client's token (or its lack of one); the message says which and the fix."""


def refused(missing: bool | None = None) -> AuthRefused:
    """The one-line error for a refused token; `missing` from an HTTP 401 (True) or 403 (False),
    else decided by whether this process has a token at all."""
    source = token_source() if os.environ.get("RAY_AUTH_MODE", "token").lower() == "token" else None
    if missing is None:
        missing = source is None
    if missing:
        how = ("RAY_AUTH_MODE=disabled is set; unset it" if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled"
               else "looked in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH and ~/.ray/auth_token")
        return AuthRefused(f"the Ray cluster requires an authentication token and this client sent none ({how}); "
                               f"{GET_TOKEN}: export RAY_AUTH_TOKEN=<that token>")
    return AuthRefused(f"the Ray cluster refused the authentication token from {source or 'this client'}: it is "
                           f"not this cluster's token; {GET_TOKEN}: export RAY_AUTH_TOKEN=<that token>")


def from_ray(e: Exception) -> AuthRefused:
    """Ray's AuthenticationError as one line (its HTTP texts tell a missing token from a wrong one)."""
    text = str(e)
    return refused(True if "Authentication required" in text else False if "Authentication failed" in text else None)


@contextlib.contextmanager
def connecting():
    """Around a connection to a Ray cluster: token mode if a token exists, the core's log of refused
    handshakes held back, and a refusal raised as AuthRefused (a ConnectionError)."""
    from ray.exceptions import AuthenticationError

    use_token_if_available()
    sys.stderr.flush()
    saved = os.dup(2)
    log = tempfile.TemporaryFile()
    os.dup2(log.fileno(), 2)
    try:
        yield
    except AuthenticationError as e:
        raise from_ray(e) from None
    except ConnectionError:
        if _core_log(log)[1]:
            raise refused() from None
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        sys.stderr.write(_core_log(log)[0])
        log.close()


def _core_log(log) -> tuple[str, bool]:
    """(what the core printed, less refused handshakes; whether any handshake was refused)."""
    log.seek(0)
    lines = log.read().decode(errors="replace").splitlines(keepends=True)
    kept = [x for x in lines if not _REFUSED.search(x)]
    return "".join(kept), len(kept) < len(lines)
