"""RoFormer (rotary position embeddings) as a first-class Hugging Face transformers model.

Importing the package registers `model_type="roformer_hf"` with AutoConfig, AutoTokenizer and every Auto model
class it implements (`modeling.HEADS`); transformers' own `model_type="roformer"` is left untouched. It also imports
the tools that every model's saving, loading and pushing use, which register their hooks with `loading.py` at their
import: model cards and uploads (`hub.py`), sentence-transformers' module files (`sentence.py`). The modeling code,
copied into every saved folder, imports none of them.
"""

import transformers

from . import hub, modeling, sentence  # noqa: F401  (tools: they register their hooks at import)
from .configuration import RoFormerConfig
from .modeling import *  # noqa: F403  (the classes of modeling.HEADS, see modeling.__all__)
from .summary import summary
from .tokenization import RoFormerHFTokenizer, train_tokenizer

__version__ = "0.3.0.dev0"

transformers.AutoConfig.register(RoFormerConfig.model_type, RoFormerConfig, exist_ok=True)
for _head in modeling.HEADS:
    getattr(transformers, _head.auto_class).register(RoFormerConfig, _head.model_class, exist_ok=True)
transformers.AutoTokenizer.register(RoFormerConfig, tokenizer_class=RoFormerHFTokenizer, exist_ok=True)

__all__ = ["RoFormerConfig", *modeling.__all__, "RoFormerHFTokenizer", "train_tokenizer", "summary"]


def __getattr__(name: str):
    if name == "RoFormerTokenizerFast":  # the tokenizer's former name (tokenization.__getattr__ warns)
        from . import tokenization

        return tokenization.RoFormerTokenizerFast
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
