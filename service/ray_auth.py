"""Ray's token authentication, as the control plane uses it.

Every Ray head this service talks to wants a token (`RAY_AUTH_MODE=token`): the embedded
head that `pstar serve` starts makes one per data dir (`local_token`), a cluster's comes
from a Secret (KubeRay's `authOptions`, k8s/). Ray's own clients find the token in the
environment (`RAY_AUTH_TOKEN`, or a file named by `RAY_AUTH_TOKEN_PATH`); our plain HTTP
calls to the dashboard (Serve's REST API, the node summary, the version) send it as
`headers()`. Drivers and workers inherit it from the head they run on.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, MutableMapping
from pathlib import Path

MODE, TOKEN, TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
TOKEN_FILE = "auth_token"  # in the embedded head's state dir


def local_token(state_dir: Path) -> Path:
    """The file holding the embedded head's token (made once, readable by its owner only)."""
    path = state_dir / TOKEN_FILE
    if not path.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def local_env(token_file: Path) -> dict[str, str]:
    """The environment entries that make a process use the embedded head's token (the token
    itself stays in its file, out of every process's environment)."""
    return {MODE: "token", TOKEN_PATH: str(token_file)}


def use(env: dict[str, str], into: MutableMapping[str, str] | None = None) -> None:
    """Make this process (or `into`) use `env`'s token, dropping an inherited one."""
    target: MutableMapping[str, str] = os.environ if into is None else into
    target.pop(TOKEN, None)  # it would win over the file
    target.update(env)


def token(given: Mapping[str, str] | None = None) -> str | None:
    """The token this process would send, as Ray looks for it; None with auth off."""
    env = os.environ if given is None else given
    if env.get(MODE, "").lower() != "token":
        return None
    if env.get(TOKEN):
        return env[TOKEN].strip()
    path = Path(env[TOKEN_PATH]) if env.get(TOKEN_PATH) else Path.home() / ".ray" / "auth_token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def headers(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The header a request to a Ray dashboard carries (none with auth off)."""
    t = token(env)
    return {"Authorization": f"Bearer {t}"} if t else {}
