"""Who may speak on the control plane (DESIGN 4.4): ZeroMQ CURVE between the frontend's
ROUTER and its workers, keyed per worker incarnation.

    frontend  ServerKeys, made at start; only its public key ever leaves the process
    launcher  one WorkerSecret per worker incarnation: the server's public key and a fresh
              client keypair; the client's public key is registered with the frontend
              (KeyRing.allow(identity, key)) before the worker starts, and revoked when
              that incarnation is removed
    worker    gets its WorkerSecret from the runtime, never on its command line nor in its
              environment (LocalRuntime: on stdin), and connects as a CURVE client: it
              talks to the real frontend only, and the frontend knows which worker it is

The ZAP handler (pyzmq's ThreadAuthenticator, a thread of its own so handshakes go on
while the event loop is busy) accepts only registered keys and names each connection by
the identity its key was registered for: ZeroMQ attaches that name (the ZAP User-Id) to
every frame of the connection, and the frontend's link drops any frame whose routing id
is another, so one worker's key cannot speak for another. CURVE encrypts and
authenticates every frame (Curve25519, XSalsa20-Poly1305), so this holds across hosts.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

ZAP_DOMAIN = "splitserve"
KEY_LEN = 40  # a Curve25519 key (32 bytes) as Z85 text
_MAGIC = b"splitserve-curve/2"

# The largest control message either side accepts (ZMQ_MAXMSGSIZE, per frame); a peer
# that sends more is disconnected by ZeroMQ before the frame is buffered. Sized from the
# largest real messages: a KVSnapshot costs 18 bytes per cached block (a 16-byte hash and
# its msgpack header), so 32 MiB holds a pool of 1.8M blocks; a Generate carries at most
# 5 bytes per prompt or resumed token, so 32 MiB holds 6.7M tokens. Decoded, a frame of
# one-byte integers becomes a list of 8-byte pointers: at most ~256 MiB per message.
MAX_MESSAGE_BYTES = 32 << 20


def _check_key(name: str, key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_LEN:
        raise ValueError(f"{name} must be a {KEY_LEN}-byte Z85 CURVE key")
    try:
        if len(z85.decode(key)) != 32:
            raise ValueError
    except (ValueError, KeyError, IndexError):
        raise ValueError(f"{name} is not Z85 text") from None
    return key


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """The frontend's CURVE keypair (Z85 text)."""
    public: bytes
    secret: bytes = field(repr=False)

    @staticmethod
    def generate() -> ServerKeys:
        public, secret = zmq.curve_keypair()
        return ServerKeys(public, secret)

    def serve(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        """Makes `sock` a CURVE server whose handshakes go to the ZAP handler."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


STORE_KEY_BYTES = 32


@dataclass(frozen=True, slots=True)
class WorkerSecret:
    """What one worker incarnation needs to join: the frontend's public key (so it talks
    to no impostor) and its own keypair. Runtime-neutral bytes: LocalRuntime writes them
    to the child's stdin; another runtime may hand them over its own way."""
    server_public: bytes
    client_public: bytes
    client_secret: bytes = field(repr=False)
    # The cluster's KV store key (the disk tier's per-tenant keys derive from it); empty:
    # no disk tier. The same for every worker of one frontend start (or key file).
    store_key: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        _check_key("server_public", self.server_public)
        _check_key("client_public", self.client_public)
        _check_key("client_secret", self.client_secret)
        if self.store_key and len(self.store_key) != STORE_KEY_BYTES:
            raise ValueError(f"store_key must be {STORE_KEY_BYTES} bytes")

    @staticmethod
    def generate(server_public: bytes, store_key: bytes = b"") -> WorkerSecret:
        public, secret = zmq.curve_keypair()
        return WorkerSecret(server_public, public, secret, store_key)

    def to_bytes(self) -> bytes:
        return b"\n".join((_MAGIC, self.server_public, self.client_public,
                           self.client_secret, self.store_key.hex().encode())) + b"\n"

    @staticmethod
    def from_bytes(data: bytes) -> WorkerSecret:
        lines = data.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()  # the final newline
        if len(lines) != 5 or lines[0] != _MAGIC:
            raise ValueError("no control-plane secret: a worker reads one from its runtime "
                             "(LocalRuntime writes it to stdin); start workers with "
                             "`splitserve serve`, not by hand")
        try:
            store_key = bytes.fromhex(lines[4].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise ValueError("the control-plane secret's store key is not hex") from None
        return WorkerSecret(lines[1], lines[2], lines[3], store_key)

    def connect(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        """Makes `sock` a CURVE client of the frontend (before it connects)."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


def check_identity(identity: bytes) -> str:
    """A routing id the launcher may register: printable ASCII, 1-255 bytes (ZeroMQ's
    limit; it reserves ids starting with a zero byte for the ones it makes up)."""
    if (not 0 < len(identity) <= 255 or not identity.isascii()
            or not identity.decode().isprintable()):
        raise ValueError(f"identity {identity!r} must be 1-255 printable ASCII bytes")
    return identity.decode()


class KeyRing:
    """Registered client keys and the identity each speaks for. Written by the event loop,
    read by the ZAP thread: hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[bytes, bytes] = {}
        self._by_identity: dict[bytes, bytes] = {}

    def allow(self, identity: bytes, public_key: bytes) -> None:
        """Lets `public_key` connect as `identity` (replacing a key it had before)."""
        check_identity(identity)
        _check_key("public_key", public_key)
        with self._lock:
            if self._by_key.get(public_key, identity) != identity:
                raise ValueError("this key is registered for another identity")
            old = self._by_identity.pop(identity, None)
            if old is not None:
                del self._by_key[old]
            self._by_key[public_key] = identity
            self._by_identity[identity] = public_key

    def revoke(self, identity: bytes) -> None:
        """No new connection with that identity's key. One already made goes on (CURVE
        authenticates at the handshake): the frontend fences removed incarnations."""
        with self._lock:
            key = self._by_identity.pop(identity, None)
            if key is not None:
                del self._by_key[key]

    def identity_of(self, public_key: bytes) -> bytes | None:
        with self._lock:
            return self._by_key.get(public_key)

    def is_allowed(self, identity: bytes) -> bool:
        with self._lock:
            return identity in self._by_identity


class ControlAuthenticator(ThreadAuthenticator):
    """The ZAP handler of one context: CURVE clients whose key is in `keys` are let in,
    under the identity registered for it (the ZAP User-Id); any other is refused."""

    def __init__(self, context: zmq.Context, keys: KeyRing) -> None:  # type: ignore[type-arg]
        # NOTE: ZAP is per libzmq context; `context` must share the server socket's.
        super().__init__(context)
        self.keys = keys

    def start(self) -> None:
        super().start()
        self.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: `key` is Z85 text."""
        return domain == ZAP_DOMAIN and self.keys.identity_of(key) is not None

    def curve_user_id(self, client_public_key: bytes) -> str:
        identity = self.keys.identity_of(z85.encode(client_public_key))
        # Revoked between the two lookups: an empty User-Id matches no routing id.
        return "" if identity is None else identity.decode()
