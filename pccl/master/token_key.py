"""The member-token key kept in a file, so that a restarted master without a shared secret verifies the
tokens its predecessor issued (docs/security.md "Re-registration": issue 33).

Without a secret a master's token key would be random per process, and a restarted master could not tell
a member of the run from a stranger claiming a place in its rebuild. So by default the master keeps its key
in a per-user state file (:func:`default_path`: ``master-token.key`` under ``$PCCL_STATE_DIR``, else
``$XDG_STATE_HOME/pccl``, else ``~/.local/state/pccl``), read or created on start (32 random bytes, hex,
mode 0600, created exclusively so that two masters starting at once read the same key, never rewritten).
``MasterConfig.token_key_file`` names another file. Every master started with the same file (the same
process restarted, a standby of the same user on the same host, or one elsewhere given a copy) verifies
every generation's tokens, as with a secret, and refuses a claim without a valid one. The masters of one
user on one host share the default key: a member of one of its runs could prove membership to another's
restarted master, which gives it nothing that open membership (no secret) does not already give; give
each run its own file to keep them apart. A master that cannot keep its key (the state directory is not
writable, the file readable by others) logs why and refuses claims it cannot verify rather than take them
on trust: its members join again as newcomers after a restart. ``token_key_file=""`` asks for the old
behaviour (a key of this process only, claims taken on trust while rebuilding). The file is a
credential: whoever reads it can forge a member's re-registration (not a P2P connection: those need the
member's own X25519 key).

I/O only; the tokens themselves are pure (pccl/master/tokens.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Mapping

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
    if not os.path.exists(path):
        _create(path)
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


def _create(path: str) -> None:
    """Make the key file at ``path`` whole or not at all: the key is written to a file of this process
    first and linked to ``path`` (atomic, refused if ``path`` exists), so a master starting at the same
    moment never reads a file that is created but not yet written; the one that links first wins."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_bytes(TOKEN_BYTES).hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return
        log.info("made a new member-token key in %s", path)
    except OSError as exc:
        raise InvalidArgumentError(f"token key file {path}: cannot create it ({exc.strerror})") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def default_path(env: Mapping[str, str] | None = None) -> str:
    """The per-user file of the member-token key: ``master-token.key`` under ``$PCCL_STATE_DIR``, else
    ``$XDG_STATE_HOME/pccl``, else ``~/.local/state/pccl``."""
    env = os.environ if env is None else env
    base = env.get("PCCL_STATE_DIR") or os.path.join(
        env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state"), "pccl")
    return os.path.join(base, "master-token.key")


def member_tokens(secret: str | None, key_file: str | None) -> MemberTokens:
    """The master's member tokens: from the shared secret if there is one; else from ``key_file`` (made
    if missing; None: :func:`default_path`; "": none, a random key of this process whose master takes
    another master's members on trust while it rebuilds).

    Raises:
        InvalidArgumentError: a ``key_file`` given explicitly cannot be used (see :func:`load_or_create`).
    """
    if secret or key_file == "":
        return MemberTokens.for_secret(secret)
    if key_file is not None:
        return MemberTokens(load_or_create(key_file), shared=True)
    path = default_path()
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        key = load_or_create(path)
    except (OSError, InvalidArgumentError) as exc:
        why = exc.message if isinstance(exc, InvalidArgumentError) else f"{path}: {exc.strerror}"
        log.warning("cannot keep the member-token key (%s): members of this master cannot prove themselves "
                    "to a restarted one, whose claims are then refused (they join again as newcomers); "
                    "give --token-key-file PATH or a --secret", why)
        return MemberTokens(secrets.token_bytes(TOKEN_BYTES), shared=True)
    log.info("member-token key in %s: every master of the run needs this key (the file, or a --secret) "
             "to take its members back after a restart", path)
    return MemberTokens(key, shared=True)


__all__ = ["default_path", "load_or_create", "member_tokens"]
