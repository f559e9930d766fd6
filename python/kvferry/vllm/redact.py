"""What a client may read of a server's reasons: the reason, without the deployment's
addresses. Every form kvferry writes a place in is replaced by ``<address>``:

```
staging+tcp://10.0.0.5:4100, unix:///run/kvferry/r.sock, http://decode:8000   URLs (any transport+)
tcp 10.0.0.7:49014, tcp [fd00::7]:49014                                       a TCP peer (wire.peer_name)
pid 4242                                                                      a Unix-socket peer (wire.peer_name)
10.0.0.5:4100, [fd00::5]:4100                                                 a bare address and port
```
so ``sender #1 (tcp 10.0.0.7:49014)`` reads ``sender #1 (<address>)``. The full reason stays in
the server's own log, where it was written when the transfer ended. Used where reasons leave a
server: the ``status`` answers (`kvferry.vllm.metadata.Outcome`) and the proxy's errors.
"""

from __future__ import annotations

import re

__all__ = ["ADDRESS", "scrub"]

ADDRESS = re.compile(
    r"\b(?:[a-z][a-z0-9-]*\+)?(?:unix|tcp|https?)://(?:\[[0-9A-Fa-f:.%]*\])?(?:[^\s'\"()<>,;\]]*[^\s'\"()<>,;\]:.])?"
    r"|\btcp (?:\[[0-9A-Fa-f:.%]+\]|[\w.-]+):\d+"
    r"|\bpid \d+"
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"
    r"|\[[0-9A-Fa-f]*:[0-9A-Fa-f]*:[0-9A-Fa-f:.%]*\](?::\d+)?"
)


def scrub(text: str) -> str:
    """``text`` with every address kvferry writes replaced by ``<address>``."""
    return ADDRESS.sub("<address>", str(text))
