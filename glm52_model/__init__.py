"""A GLM-5.2-style decoder stack (MLA + DSA indexer/top-k + sparse MLA, MoE, tile-wise FP8, MTP) whose
decoder layers compile whole under activation checkpointing."""
from .config import GLM52Config
from .model import GLM52ForCausalLM

__all__ = ["GLM52Config", "GLM52ForCausalLM"]
