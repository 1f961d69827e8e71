"""The sacpass partition function: tag, call PyTorch's min-cut, offload, audit, report."""
from .context import CompileContext, GraphIds, PartitionConfig, PartitionResult, active, current
from .partition_fn import make_partitioner, partition

__all__ = ["CompileContext", "GraphIds", "PartitionConfig", "PartitionResult", "active", "current",
           "make_partitioner", "partition"]
