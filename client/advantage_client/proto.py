"""The generated ``advantage.v1`` stubs, under a public name.

    from advantage_client.proto import advantage_pb2, advantage_pb2_grpc

``advantage_pb2``: the messages and enums of ``proto/advantage/v1/advantage.proto``; ``advantage_pb2_grpc``:
``AdvantageServiceStub`` and ``AdvantageServiceServicer``. The modules under ``advantage_client._proto`` are
where ``scripts/gen_proto.py`` writes them (the generated imports name that path); import them from here.
"""
from advantage_client._proto.advantage.v1 import advantage_pb2, advantage_pb2_grpc

__all__ = ["advantage_pb2", "advantage_pb2_grpc"]
