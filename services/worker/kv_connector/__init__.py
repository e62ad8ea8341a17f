"""The KV connector: moves a sequence's KV pages from a prefill worker to a decode worker.

Control goes through the scheduler (it orders a send in a step message and hears the result);
data goes worker to worker through a `KvTransport`. Pages are fed layer by layer (`LayerFeed`),
as each layer's KV becomes final during the forward pass when the order rides on that step.
Orders and results are the step protocol's `SendOrder` and `SendResult` (kvrelay.step_messages);
only the gRPC transport's wire code (grpc_transport.py) handles protobuf.
"""
from kvrelay.worker.kv_connector.base import KvTransport, TransferFailed
from kvrelay.worker.kv_connector.feed import LayerFeed
from kvrelay.worker.kv_connector.grpc_transport import GrpcKvTransport, KvTransferService
from kvrelay.worker.kv_connector.receiver import KvReceiver, PageChunk
from kvrelay.worker.kv_connector.sender import KvSender
from kvrelay.worker.kv_connector.shm_transport import ShmKvTransport

__all__ = ["KvTransport", "TransferFailed", "LayerFeed", "GrpcKvTransport", "KvTransferService",
           "KvReceiver", "PageChunk", "KvSender", "ShmKvTransport"]
