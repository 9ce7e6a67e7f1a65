"""The member-token key kept in a file, so that a restarted master without a shared secret verifies the
tokens its predecessor issued (docs/security.md "Re-registration": issue 33).

Without a secret a master's token key is random per process, and a restarted master cannot tell a member
of the run from a stranger claiming a place in its rebuild. With ``MasterConfig.token_key_file`` the master
reads its key from that file, or creates it (32 random bytes, hex, mode 0600, created exclusively so
that two masters starting at once end up with the same key) on first start: every master started with
the file, the same process restarted or a standby that reads the same file, then verifies every
generation's tokens, as with a secret. The file is a credential: whoever reads it can forge a member's
re-registration (not a P2P connection: those need the member's own X25519 key).

I/O only; the tokens themselves are pure (pccl/master/tokens.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import stat

from .._errors import InvalidArgumentError
from .tokens import TOKEN_BYTES, MemberTokens

log = logging.getLogger("pccl.master")


def _parse(path: str, text: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != TOKEN_BYTES:
        raise InvalidArgumentError(
            f"token key file {path}: expected {2 * TOKEN_BYTES} hex digits (a key this master wrote); "
            "remove it to have a new one made (members of the old run must then join again)")
    return key


def load_or_create(path: str) -> bytes:
    """The key in ``path``, made there first if the file does not exist.

    Raises:
        InvalidArgumentError: the file cannot be read or written, or holds no key; or others than its
            owner may read it.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:
        raise InvalidArgumentError(f"token key file {path}: cannot create it ({exc.strerror})") from None
    else:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_bytes(TOKEN_BYTES).hex() + "\n")
        log.info("made a new member-token key in %s", path)
    try:
        st = os.stat(path)
        with open(path, encoding="ascii") as f:
            text = f.read(4 * TOKEN_BYTES)
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not text"
        raise InvalidArgumentError(f"token key file {path}: cannot read it ({why})") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InvalidArgumentError(f"token key file {path}: others than its owner may read it "
                                   f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    return _parse(path, text)


def member_tokens(secret: str | None, key_file: str | None) -> MemberTokens:
    """The master's member tokens: from the shared secret if there is one, else from ``key_file``
    (made if missing), else a random key of this process."""
    if secret or key_file is None:
        return MemberTokens.for_secret(secret)
    return MemberTokens(load_or_create(key_file), shared=True)


__all__ = ["load_or_create", "member_tokens"]
