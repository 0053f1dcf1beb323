"""gRPC plumbing shared by the router and the workers: servers, channels, API keys, TLS.

Every server binds 127.0.0.1 unless told otherwise; every call a client makes carries a
deadline; messages are protobuf only.
"""
from __future__ import annotations

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


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <key>`, except the listed open methods."""

    def __init__(self, api_key: str, open_methods: tuple[str, ...] = ()) -> None:
        self._expected = f"Bearer {api_key}"
        self._open = open_methods

        def deny(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        if details.method.endswith(self._open):
            return continuation(details)
        meta = dict(details.invocation_metadata or ())
        if meta.get("authorization") == self._expected:
            return continuation(details)
        handler = continuation(details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def make_server(host: str, port: int, max_workers: int = 64, api_key: str | None = None,
                tls: TLSConfig | None = None, open_methods: tuple[str, ...] = ("/Health",),
                ) -> tuple[grpc.Server, int]:
    """A thread-pool gRPC server bound to host:port (port 0 = pick one). Returns (server, port)."""
    interceptors = [ApiKeyInterceptor(api_key, open_methods)] if api_key else []
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


def make_channel(address: str, tls: TLSConfig | None = None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=_OPTIONS)
    creds = grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file) if tls.ca_file else None)
    return grpc.secure_channel(address, creds, options=_OPTIONS)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
