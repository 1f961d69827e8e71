"""The sacpass partition function: tag, call PyTorch's min-cut, audit, report."""
from .audit import audit_partition, build_report
from .partition_fn import PartitionResult, SacpassPartitioner, partition

__all__ = ["audit_partition", "build_report", "partition", "PartitionResult", "SacpassPartitioner"]
