"""Joint-graph passes. Each module owns one pass: ``<verb>_pass(gm, ...)``."""
from .must_save import TagRecord, TagResult, tag_must_save_pass

__all__ = ["TagRecord", "TagResult", "tag_must_save_pass"]
