"""gRPC plumbing shared by the router and the workers: servers, channels, credentials, TLS.

Every server binds 127.0.0.1 unless told otherwise; every call a client makes carries a
deadline; messages are protobuf only.

Two credentials, never confused (each has its own metadata key):
  * the client API key (`authorization: Bearer KEY`) guards the router's public face, when
    configured; its Health stays open for load balancers;
  * the cluster secret (`x-pdserve-cluster-secret`) guards every worker RPC, always, Health
    included: a worker answers only the router and its peers. The router's channels and a
    decode worker's channel to its prefill peers attach it through client interceptors, so
    no call site can forget it.
"""
from __future__ import annotations

import collections
import hmac
import secrets
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# servers own their port: without this, gRPC sets SO_REUSEPORT and a second server on the same
# port silently takes a share of the connections
_SERVER_OPTIONS = [*_OPTIONS, ("grpc.so_reuseport", 0)]


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str
    key_file: str
    ca_file: str | None = None  # clients: trust this CA; servers: require client certs


CLUSTER_SECRET_HEADER = "x-pdserve-cluster-secret"
MIN_SECRET_CHARS = 16


def new_cluster_secret() -> str:
    """A fresh cluster secret: 256 random bits, URL-safe text (43 characters)."""
    return secrets.token_urlsafe(32)


def check_cluster_secret(secret: object, field: str = "cluster_secret") -> str:
    if not isinstance(secret, str) or len(secret.strip()) < MIN_SECRET_CHARS:
        raise ValueError(f"{field}: must be a string of at least {MIN_SECRET_CHARS} characters "
                         "(pdserve serve generates one; --cluster-secret-file reads one)")
    if not secret.isprintable() or secret != secret.strip():
        raise ValueError(f"{field}: must be printable with no surrounding whitespace")
    return secret


def read_secret_file(path: str, field: str = "--cluster-secret-file") -> str:
    """The secret in `path` (a mounted Kubernetes secret, say), trailing newline dropped."""
    try:
        text = _read(path).decode()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{field}: cannot read {path!r}: {e}") from e
    return check_cluster_secret(text.rstrip("\r\n"), field)


class MetadataAuthInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose metadata lacks `header: expected` (compared in constant time),
    except the listed open methods."""

    def __init__(self, header: str, expected: str, open_methods: tuple[str, ...] = (),
                 what: str = "credential") -> None:
        self._header, self._expected = header, expected.encode()
        self._open = open_methods

        def deny(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or invalid {what}")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        if self._open and details.method.endswith(self._open):
            return continuation(details)
        given = dict(details.invocation_metadata or ()).get(self._header)
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected):
            return continuation(details)
        handler = continuation(details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def api_key_interceptor(api_key: str, open_methods: tuple[str, ...] = ("/Health",),
                        ) -> MetadataAuthInterceptor:
    """The router's client check: `authorization: Bearer KEY`."""
    return MetadataAuthInterceptor("authorization", f"Bearer {api_key}", open_methods, "API key")


def cluster_interceptor(secret: str) -> MetadataAuthInterceptor:
    """The workers' check: the cluster secret on every method, Health included."""
    return MetadataAuthInterceptor(CLUSTER_SECRET_HEADER, check_cluster_secret(secret), (),
                                   "cluster credential")


def make_server(host: str, port: int, max_workers: int = 64,
                auth: grpc.ServerInterceptor | None = None, tls: TLSConfig | None = None,
                ) -> tuple[grpc.Server, int]:
    """A thread-pool gRPC server bound to host:port (port 0 = pick one), calls checked by
    `auth` (api_key_interceptor / cluster_interceptor). Returns (server, port)."""
    interceptors = [auth] if auth is not None else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=_SERVER_OPTIONS, interceptors=interceptors)
    address = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        creds = grpc.ssl_server_credentials(
            [(_read(tls.key_file), _read(tls.cert_file))],
            root_certificates=_read(tls.ca_file) if tls.ca_file else None,
            require_client_auth=tls.ca_file is not None)
        bound = server.add_secure_port(address, creds)
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {address}")
    return server, bound


def make_channel(address: str, tls: TLSConfig | None = None,
                 cluster_secret: str | None = None) -> grpc.Channel:
    """A blocking channel; with `cluster_secret`, every call carries it (worker peers)."""
    if tls is None:
        channel = grpc.insecure_channel(address, options=_OPTIONS)
    else:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(tls.ca_file) if tls.ca_file else None)
        channel = grpc.secure_channel(address, creds, options=_OPTIONS)
    if cluster_secret is None:
        return channel
    return grpc.intercept_channel(channel, _AttachSecret(check_cluster_secret(cluster_secret)))


def make_aio_channel(address: str, cluster_secret: str) -> grpc.aio.Channel:
    """An asyncio channel to a worker (the router's pool): every call carries the secret.
    Worker services listen on the cluster's private side without TLS (worker/server.py)."""
    secret = check_cluster_secret(cluster_secret)
    return grpc.aio.insecure_channel(address, options=_OPTIONS, interceptors=[
        _AioAttachUnary(secret), _AioAttachStream(secret)])


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _AttachSecret(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, secret: str) -> None:
        self._pair = (CLUSTER_SECRET_HEADER, secret)

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._pair],
                            d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def _aio_details(d: grpc.aio.ClientCallDetails, secret: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(d.metadata or ()))
    metadata.add(CLUSTER_SECRET_HEADER, secret)
    return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials,
                                      d.wait_for_ready)


# grpc.aio files an interceptor under its first matching kind only: one class per kind
class _AioAttachUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details, self._secret), request)


class _AioAttachStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details, self._secret), request)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
