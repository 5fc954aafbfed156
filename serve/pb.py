"""The generated protobuf modules, regenerated first if protos/ changed (see serve.protogen)."""

from serve.protogen import ensure_generated

ensure_generated()

from serve._proto.encoder.v1 import encoder_pb2 as pb  # noqa: E402
from serve._proto.encoder.v1 import encoder_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc"]
