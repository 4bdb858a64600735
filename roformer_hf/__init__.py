"""RoFormer (rotary position embeddings) as a first-class Hugging Face transformers model.

Importing the package registers `model_type="roformer_hf"` with AutoConfig, AutoTokenizer and every Auto model
class it implements; transformers' own `model_type="roformer"` is left untouched.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from .configuration import RoFormerConfig
from .modeling import (
    RoFormerForMaskedLM,
    RoFormerForMultipleChoice,
    RoFormerForQuestionAnswering,
    RoFormerForSequenceClassification,
    RoFormerForTokenClassification,
    RoFormerModel,
    RoFormerPreTrainedModel,
)
from .summary import summary
from .tokenization import RoFormerTokenizerFast, train_tokenizer

__version__ = "0.2.0"

AutoConfig.register(RoFormerConfig.model_type, RoFormerConfig, exist_ok=True)
for _auto, _model in (
    (AutoModel, RoFormerModel),
    (AutoModelForMaskedLM, RoFormerForMaskedLM),
    (AutoModelForSequenceClassification, RoFormerForSequenceClassification),
    (AutoModelForTokenClassification, RoFormerForTokenClassification),
    (AutoModelForQuestionAnswering, RoFormerForQuestionAnswering),
    (AutoModelForMultipleChoice, RoFormerForMultipleChoice),
):
    _auto.register(RoFormerConfig, _model, exist_ok=True)
AutoTokenizer.register(RoFormerConfig, tokenizer_class=RoFormerTokenizerFast, exist_ok=True)

__all__ = [
    "RoFormerConfig",
    "RoFormerPreTrainedModel",
    "RoFormerModel",
    "RoFormerForMaskedLM",
    "RoFormerForSequenceClassification",
    "RoFormerForTokenClassification",
    "RoFormerForQuestionAnswering",
    "RoFormerForMultipleChoice",
    "RoFormerTokenizerFast",
    "train_tokenizer",
    "summary",
]
