"""Health over HTTP, open (no bearer token, as gRPC health): what probes and balancers ask. Every answer is
admission's one readiness (serve/core/admission.py `ready`: serving, and not leaving), the same that gRPC
health, KServe v2's ServerReady and ModelReady give.

  GET /health            TEI's and k8s-style probes: 200 when ready, 503 when not
  GET /v2/health/live    KServe v2: 200 while the process answers
  GET /v2/health/ready   KServe v2: 200 when ready, 503 when not
Each answers {"live": true, "ready": bool}.
"""

from __future__ import annotations

import orjson

from serve.protocols.edge import Api
from serve.protocols.routing import Family, HttpCall, Route


def error_body(status: int, message: str) -> bytes:
    return orjson.dumps({"error": message})


def ready(api: Api, rpc, call: HttpCall) -> None:
    """Ready: serving, and not leaving (200), else 503."""
    now = api.ready()
    rpc.reply_http(200 if now else 503, orjson.dumps({"live": True, "ready": now}))


def live(api: Api, rpc, call: HttpCall) -> None:
    """Live: the process answers (200), saying whether it is ready."""
    rpc.reply_http(200, orjson.dumps({"live": True, "ready": api.ready()}))


FAMILY = Family("health", error_body, (
    Route("GET", "/health", ready, body="none", open=True),
    Route("GET", "/v2/health/live", live, body="none", open=True),
    Route("GET", "/v2/health/ready", ready, body="none", open=True),
))
