"""Graph passes. Each module owns one pass: ``<verb>_pass(gm, ...)``. ``tag_must_save_pass`` works on the
AOTAutograd joint graph; ``route_checkpoints_pass`` on the Dynamo graph, before AOTAutograd traces it."""
from .checkpoint_regions import route_checkpoints_pass
from .must_save import TagRecord, TagResult, tag_must_save_pass

__all__ = ["TagRecord", "TagResult", "tag_must_save_pass", "route_checkpoints_pass"]
