"""transformers' `fill-mask`, `text-classification` and `text-generation` pipelines run our models."""

import torch
import transformers
from helpers import WORDS, tiny_config

from roformer_hf import (
    RoFormerForCausalLM,
    RoFormerForMaskedLM,
    RoFormerForSequenceClassification,
    RoFormerHFTokenizer,
)


def _tokenizer(folder):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = RoFormerHFTokenizer.from_pretrained(folder)
    assert tokenizer.tokenize("the king") == ["the", "king"]  # the vocabulary really loaded
    return tokenizer


def test_fill_mask_pipeline(tmp_path):
    tokenizer = _tokenizer(tmp_path)
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(tiny_config(vocab_size=len(tokenizer))).eval()
    fill = transformers.pipeline("fill-mask", model=model, tokenizer=tokenizer, top_k=3)
    predictions = fill(["the king [MASK] a crown", "night and [MASK]"])
    assert len(predictions) == 2 and all(len(p) == 3 for p in predictions)

    # The pipeline's top choice is the argmax of our logits at the masked position.
    encoded = tokenizer("the king [MASK] a crown", return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits[0, 3]
    assert predictions[0][0]["token"] == int(logits.argmax())
    assert abs(predictions[0][0]["score"] - float(logits.softmax(-1).max())) < 1e-5


def test_text_classification_pipeline(tmp_path):
    tokenizer = _tokenizer(tmp_path)
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tokenizer), num_labels=2, id2label={0: "comedy", 1: "tragedy"},
                         label2id={"comedy": 0, "tragedy": 1})
    model = RoFormerForSequenceClassification(config).eval()
    classify = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer)
    texts = ["the queen loves the king", "a sword at night and the king dies"]
    results = classify(texts)
    assert [r["label"] in ("comedy", "tragedy") for r in results] == [True, True]

    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        probabilities = model(**batch).logits.softmax(-1)
    for result, row in zip(results, probabilities):
        assert result["label"] == config.id2label[int(row.argmax())]
        assert abs(result["score"] - float(row.max())) < 1e-5


def test_text_generation_pipeline(tmp_path):
    """The pipeline's greedy continuation is the model's own `generate` on the same prompt."""
    tokenizer = _tokenizer(tmp_path)
    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(vocab_size=len(tokenizer), is_decoder=True)).eval()
    generate = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    result = generate("the king loves", max_new_tokens=4, min_new_tokens=4, do_sample=False,
                      return_tensors=True)
    prompt = tokenizer("the king loves", return_tensors="pt")  # as the pipeline encodes it: [CLS] ... [SEP]
    expected = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert result[0]["generated_token_ids"][-4:] == expected[0, -4:].tolist()
