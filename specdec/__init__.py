"""specdec: lossless speculative decoding for Llama-family models, on CPU or GPU."""
from specdec.config import EngineConfig, ModelConfig, SamplingParams, SpecdecError, StructuredOutput
from specdec.drafting import SpeculativeConfig
from specdec.engine.outputs import RequestOutput
from specdec.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "SpeculativeConfig", "RequestOutput", "EngineConfig",
           "ModelConfig",
           "SpecdecError"]
__version__ = "0.1.0"
