# The load balancer in front of N serving replicas: HAProxy from Debian's packages with
# docker/haproxy.cfg (gRPC on 8080: HTTP/2 per-request round robin, gRPC health checks; HTTP/1.1 on 8081:
# keep-alive, /v2/health/ready checks, retries across a replica restart; Docker DNS discovery).
#   docker build -f docker/lb.Dockerfile -t onnx-encoder-lb .
# The base defaults to the serving images' base (a Debian image already on a host that built them);
# any Debian >= 12 base works (HAProxy >= 2.6), e.g. --build-arg BASE_IMAGE=debian:bookworm-slim.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends haproxy \
 && rm -rf /var/lib/apt/lists/*
COPY docker/haproxy.cfg /etc/haproxy/haproxy.cfg
# The replicas' DNS name, gRPC and HTTP ports (docker-compose.yml sets LB_UPSTREAM per deployment).
ENV LB_UPSTREAM=serve LB_UPSTREAM_PORT=50051 LB_UPSTREAM_HTTP_PORT=8000
RUN haproxy -c -f /etc/haproxy/haproxy.cfg
USER haproxy
EXPOSE 8080 8081 8404
STOPSIGNAL SIGUSR1
# -W master-worker, -db foreground with logs on stdout.
ENTRYPOINT ["haproxy", "-W", "-db", "-f", "/etc/haproxy/haproxy.cfg"]
