"""A cluster's own keys, made by ``pdctl up``: the engine key (every engine requires it: SGLang's
``--api-key``) and the control-plane admin key (the router's hold, release, workers, cordon).

They live on the control machine in ``$PDCTL_HOME/NAME/keys.json`` (0600, beside the state
file, never printed or logged) and reach the processes at launch: the router and the trainer in
their environment, the engines in an SGLang ``--config`` file that the node's agent writes 0600
beside the engine's log (not on their command line, which any user of the node can read). The
client key (``router.api_key_env``) is the user's and stays in their environment.

Keys are hex: SGLang turns a config file's ``api-key: K`` into ``--api-key K``, which its
argparse refuses when K begins with '-' (a urlsafe token does, one time in 64).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from pdctl.cluster.state import StateStore
from pdctl.errors import LifecycleError
from pdctl.weights.env import CONTROL_KEY_ENV, CONTROL_KEYS_ENV, ENGINE_KEY_ENV

KEYS_FILE = "keys.json"
CONTROL_KEY_ID = "pdctl"


@dataclass(frozen=True)
class ClusterKeys:
    """A cluster's engine key and control-plane admin key (module docstring); its repr never shows
    them."""

    engine: str
    control: str

    @classmethod
    def generate(cls) -> ClusterKeys:
        """A new pair of random keys (256 bits each, hex)."""
        return cls(engine=secrets.token_hex(32), control=secrets.token_hex(32))

    def env(self) -> dict[str, str]:
        """What the router and the trainer get in their environment."""
        return {
            ENGINE_KEY_ENV: self.engine,
            CONTROL_KEY_ENV: self.control,
            CONTROL_KEYS_ENV: f"{CONTROL_KEY_ID}:pdctl control plane:admin:{self.control}",
        }

    def __repr__(self) -> str:  # never the keys themselves
        return "ClusterKeys(...)"


def keys_path(store: StateStore, name: str) -> Path:
    return store.dir(name) / KEYS_FILE


def save_keys(store: StateStore, name: str, keys: ClusterKeys) -> None:
    directory = store.dir(name)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = directory / f".{KEYS_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"engine": keys.engine, "control": keys.control}, out)
    os.replace(tmp, keys_path(store, name))


def load_keys(store: StateStore, name: str) -> ClusterKeys | None:
    """The cluster's keys; None for a cluster brought up before pdctl made keys."""
    path = keys_path(store, name)
    try:
        raw = json.loads(path.read_text())
        return ClusterKeys(engine=str(raw["engine"]), control=str(raw["control"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LifecycleError(f"the cluster's keys in {path} are unreadable: {exc}") from exc
