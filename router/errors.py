"""Errors the router answers with: one type per client-visible outcome, shared by HTTP and gRPC.

Each carries the HTTP status, OpenAI's error `type`, the field at fault (`param`) and a
machine-readable `code`; http_app turns it into `{"error": {...}}`, server.py into a gRPC
status. 4xx errors are the client's: they never count against a worker (ANCHORS #4).
"""
from __future__ import annotations

import grpc

from pdserve.engine.core.sampling_params import InvalidRequestError


class RouterError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None
    grpc_code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s
        self.counted = False  # in request_failures already (RouterCore.count_failure)

    def retry_after(self, default_s: float | None) -> str | None:
        """Seconds to come back after, as Retry-After says them: e's own, else default_s for
        a 429 or 503 (the router's configured one); None for errors that say no such thing."""
        after = self.retry_after_s
        if after is None and self.status in (429, 503):
            after = default_s
        return None if after is None else str(max(1, int(after)))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class BadRequest(RouterError):
    status, type, grpc_code = 400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT

    @classmethod
    def from_invalid(cls, e: InvalidRequestError) -> BadRequest:
        return cls(str(e), param=e.param)

    @classmethod
    def naming(cls, param: str, message: str) -> BadRequest:
        """"param: message" (cut to 500 characters), with param as the field at fault."""
        return cls(f"{param}: {message}"[:500], param=param)


class Unauthorized(RouterError):
    status, type, code = 401, "authentication_error", "invalid_api_key"
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class NotFound(RouterError):
    status, type, code = 404, "invalid_request_error", "model_not_found"
    grpc_code = grpc.StatusCode.NOT_FOUND


class PayloadTooLarge(RouterError):
    status, type, code = 413, "invalid_request_error", "request_too_large"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class Overloaded(RouterError):
    status, type, code = 429, "rate_limit_error", "overloaded"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Draining(RouterError):
    status, type, code = 503, "service_unavailable", "draining"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class WorkerUnavailable(RouterError):
    """Workers failed past the retry budget, or none is healthy: the client may retry."""

    status, type, code = 503, "service_unavailable", "worker_unavailable"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class KVTransferFailed(RouterError):
    """The KV read failed and the request's transfer_failure_policy is `fail`."""

    status, type, code = 503, "service_unavailable", "kv_transfer_failed"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class RequestTimeout(RouterError):
    status, type, code = 504, "timeout", "request_timeout"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


def param_of(details: str) -> str | None:
    """A worker's INVALID_ARGUMENT details read "<param>: <message>" (InvalidRequestError)."""
    head, sep, _ = details.partition(": ")
    return head if sep and head.replace("_", "").replace(".", "").isalnum() else None
