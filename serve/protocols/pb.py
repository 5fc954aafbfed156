"""The generated protobuf code, checked and loaded (never generated here: `python -m tools.protogen`).

Importing this fails with GeneratedCodeError, saying what to run, when serve/_proto is missing,
incomplete, edited or older than protos/ (serve/protocols/proto_stamp.py).
"""

from google.protobuf import descriptor_pb2

from serve.protocols import proto_stamp

proto_stamp.check()

from serve._proto.encoder.v1 import admin_pb2 as admin_pb  # noqa: E402
from serve._proto.encoder.v1 import admin_pb2_grpc as admin_pb_grpc  # noqa: E402
from serve._proto.encoder.v1 import encoder_pb2 as pb  # noqa: E402
from serve._proto.encoder.v1 import encoder_pb2_grpc as pb_grpc  # noqa: E402


def kserve_descriptors() -> descriptor_pb2.FileDescriptorSet:
    """protos/kserve/v2/grpc_predict_v2.proto (and what it imports), compiled by the build step."""
    return descriptor_pb2.FileDescriptorSet.FromString(
        (proto_stamp.OUT_DIR / proto_stamp.KSERVE_DESCRIPTORS).read_bytes())


__all__ = ["pb", "pb_grpc", "admin_pb", "admin_pb_grpc", "kserve_descriptors"]
