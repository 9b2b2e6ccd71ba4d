"""What a host holds of its token: a verifier, never the token.

The pool makes a host's bearer token (``atropos/backends/base.py: new_token``) and keeps it; the
host gets ``sha256:<hex>`` of it (``token_verifier``) and accepts a request whose bearer token
hashes to that (``token_matches``). So whatever relays the host's secret, and the host's own
memory, hold nothing a request can carry: a Ray actor, reachable by every job of its cluster with
``__ray_call__`` (docs/ray.md), relays only the verifier; a token of 32 random bytes cannot be
found from its SHA-256. A plain token (a host run by hand, a Nomad task's file) is still taken.
"""

from __future__ import annotations

import hashlib
import hmac

VERIFIER_PREFIX = "sha256:"


def token_verifier(token: str) -> str:
    """``sha256:<hex>`` of ``token``; a verifier is left as it is (a Ray actor relays one)."""
    if token.startswith(VERIFIER_PREFIX):
        return token
    return VERIFIER_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def token_matches(presented: bytes, expected: bytes) -> bool:
    """Whether a request's bearer token is the one ``expected`` (a verifier or a plain token)
    stands for; constant time in what is compared."""
    prefix = VERIFIER_PREFIX.encode()
    if expected.startswith(prefix):
        return hmac.compare_digest(prefix + hashlib.sha256(presented).hexdigest().encode(), expected)
    return hmac.compare_digest(presented, expected)
