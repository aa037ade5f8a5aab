"""Server reflection under both names grpcurl and other tools ask for.

grpcio-reflection ships only `grpc.reflection.v1alpha`; newer tools ask for `grpc.reflection.v1`
first. The two wire formats are identical, so v1 is served by the same servicer with the
v1alpha messages, and a v1 copy of the descriptor is added to the pool so that reflection can
describe itself under both names.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import _async, reflection_pb2

V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
V1 = "grpc.reflection.v1.ServerReflection"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName("grpc/reflection/v1/reflection.proto")
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = "grpc/reflection/v1/reflection.proto"
    fdp.package = "grpc.reflection.v1"
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for msg in fdp.message_type:
        for f in msg.field:
            if f.type_name:
                f.type_name = f.type_name.replace(old, new)
    for svc in fdp.service:
        for m in svc.method:
            m.input_type = m.input_type.replace(old, new)
            m.output_type = m.output_type.replace(old, new)
    pool.Add(fdp)


def enable(server: grpc.aio.Server, service_names: Iterable[str]) -> list[str]:
    """Registers reflection v1alpha and v1; returns their service names."""
    pool = descriptor_pool.Default()
    _add_v1_descriptor(pool)
    names = [*service_names, V1ALPHA, V1]
    servicer = _async.ReflectionServicer(names, pool=pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(V1ALPHA, {"ServerReflectionInfo": handler}),
        grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": handler}),
    ])
    return [V1ALPHA, V1]
