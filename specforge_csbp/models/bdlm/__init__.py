"""A Hugging Face causal LM trained as a block-diffusion LM (BDLM) on the CSBP core.

adapter.py   BDLMModel: the LM's attention routed through ShardedAttention (any mode), local rows only
routing.py   the registered transformers attention function + one-line "cannot be routed" errors
data.py      token sources (synthetic ramps, JSONL token ids), pure functions of the sequence id
workload.py  BDLMWorkload: the generic trainer's Workload for SFT / conversion
recipe.py    the train-bdlm recipe (pydantic; imported on demand)
"""

from .adapter import BDLMModel
from .routing import ATTENTION_NAME, check_routable
from .workload import BDLMMicroBatch, BDLMWorkload

__all__ = ["ATTENTION_NAME", "BDLMMicroBatch", "BDLMModel", "BDLMWorkload", "check_routable"]
