"""gRPC encoder service on ONNX Runtime (see docs/serving.md). Never imports torch."""
