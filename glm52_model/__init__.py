"""A GLM-5.2-style decoder stack (MLA + DSA indexer/top-k + sparse MLA, MoE, tile-wise FP8, MTP) whose
decoder layers compile whole under activation checkpointing."""
from .compile import apply_ac, apply_compile
from .config import PRESETS, GLM52Config
from .model import GLM52ForCausalLM

__all__ = ["GLM52Config", "GLM52ForCausalLM", "PRESETS", "apply_ac", "apply_compile"]
