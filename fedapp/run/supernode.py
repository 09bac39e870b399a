"""``flower-supernode`` whose fleet connection retries a TLS handshake the SuperLink's side cut short.

    python -m fedapp.run.supernode --superlink HOST:PORT --root-certificates ca.crt ...   (flower-supernode's options)

Flower's SuperNode gives up on such a handshake at once and drops the reply it was sending, which leaves the server
waiting for it (:mod:`fedapp.compat.http_retry`). This entry point applies that module's retry and then runs Flower's
own ``flower-supernode`` with the same command line; everything else about the SuperNode is Flower's. The deployment
launcher (:mod:`fedapp.run.deploy`) starts its SuperNodes this way; docs/deployment.md gives the command for a
SuperNode on another machine.
"""

from __future__ import annotations

import sys


def main() -> int | None:
    from flwr.supernode.cli.flower_supernode import flower_supernode

    from fedapp.compat.http_retry import retry_supernode_tls_eof

    retry_supernode_tls_eof()
    sys.argv[0] = "flower-supernode"
    return flower_supernode()  # type: ignore[func-returns-value]


if __name__ == "__main__":
    sys.exit(main())
