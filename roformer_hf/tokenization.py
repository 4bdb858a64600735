"""RoFormer's tokenizer: BERT-style WordPiece, optionally after jieba Chinese word segmentation.

This file imports nothing from the rest of the package: `save_pretrained` copies it next to the saved tokenizer,
so that `AutoTokenizer.from_pretrained(folder, trust_remote_code=True)` works where roformer_hf is not installed.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from tokenizers import NormalizedString, PreTokenizedString, Tokenizer, decoders, normalizers, processors
from tokenizers.models import WordPiece
from tokenizers.pre_tokenizers import BertPreTokenizer, PreTokenizer
from tokenizers.trainers import WordPieceTrainer
from transformers import PreTrainedTokenizerFast
from transformers.models.auto.tokenization_auto import get_tokenizer_config
from transformers.utils import CONFIG_NAME, cached_file

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4 in a trained vocabulary
VOCAB_FILES_NAMES = {"vocab_file": "vocab.txt", "tokenizer_file": "tokenizer.json"}
CHINESE_EXTRA = "roformer_hf[chinese]"
# transformers' RoFormer tokenizer, which always segments with jieba: the class names its folders carry, its model type.
TRANSFORMERS_CLASSES = ("RoFormerTokenizer", "RoFormerTokenizerFast")
TRANSFORMERS_MODEL_TYPE = "roformer"
DOWNLOAD_ARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


def _import_rjieba():
    try:
        import rjieba
    except ImportError as error:
        raise ImportError(
            f"use_jieba=True needs the `rjieba` package: install it with `pip install {CHINESE_EXTRA}`"
        ) from error
    return rjieba


class JiebaPreTokenizer:
    """Splits text into jieba words (`rjieba`, no HMM), as transformers' RoFormerTokenizer does.

    A word found in `vocab` stays whole; any other word is split at whitespace and, with `split_chinese_chars`,
    around each Chinese character, so WordPiece sees single characters rather than an unknown word. Without a
    vocabulary (while training one) every word stays whole.

    Custom pre-tokenizers cannot be written into tokenizer.json: `RoFormerHFTokenizer` saves a `BertPreTokenizer`
    in its place and attaches this one again when it loads.
    """

    def __init__(self, vocab: Iterable[str] | None, split_chinese_chars: bool = True):
        self._jieba = _import_rjieba()
        self._vocab = None if vocab is None else frozenset(vocab)
        # Only inserts spaces around Chinese characters: case, accents and control characters were handled by the
        # tokenizer's normalizer before pre-tokenization.
        self._char_splitter = normalizers.BertNormalizer(
            clean_text=False, handle_chinese_chars=split_chinese_chars, strip_accents=False, lowercase=False
        )

    def pre_tokenize(self, pretok: PreTokenizedString) -> None:
        pretok.split(self._split)

    def _split(self, index: int, text: NormalizedString) -> list[NormalizedString]:
        pieces = []
        for word, start, end in self._jieba.tokenize(str(text), hmm=False):
            if self._vocab is None or word in self._vocab:
                pieces.append(text[start:end])
            else:
                pieces.extend(text[start + begin:start + stop] for begin, stop in self._subword_spans(word))
        return pieces

    def _subword_spans(self, word: str) -> Iterator[tuple[int, int]]:
        """(begin, end) character spans in `word` of its whitespace-free parts, Chinese characters split apart."""
        cursor = 0
        for part in self._char_splitter.normalize_str(word).split():
            # The splitter only inserts spaces, so each part is the next occurrence in the original word.
            begin = word.index(part, cursor)
            cursor = begin + len(part)
            yield begin, cursor


class RoFormerHFTokenizer(PreTrainedTokenizerFast):
    r"""RoFormer tokenizer (🤗 tokenizers backend): BERT's WordPiece, optionally after jieba word segmentation.

    One name, `RoFormerHFTokenizer`: the class users import, what it reports when loaded, and what saved folders
    record as `tokenizer_class`. transformers resolves "RoFormerTokenizer(Fast)" to its own RoFormer tokenizer, so
    only a name of its own lets `AutoTokenizer` find this class (registered by `import roformer_hf`) whatever
    config.json lies beside the tokenizer, or none. `RoFormerTokenizerFast`, the name it was once exported under,
    still imports, with a `FutureWarning`.

    The pipeline is BERT's: a normalizer (control characters removed, optional lowercasing and accent stripping,
    spaces around Chinese characters), a whitespace-and-punctuation pre-tokenizer, WordPiece with `##`
    continuations, and the templates `[CLS] A [SEP]` / `[CLS] A [SEP] B [SEP]` with token types 0 / 1.

    With `use_jieba=True` (the published Chinese RoFormer checkpoints; needs `pip install roformer_hf[chinese]`)
    the text is first cut into words by jieba: words in the vocabulary become single tokens, the others fall back
    to characters. This gives the ids of transformers' `RoFormerTokenizer` on the same vocabulary, and, unlike it,
    the setting survives `save_pretrained` / `from_pretrained`. A folder saved by transformers' RoFormer tokenizer
    (the published `junnyu/roformer_chinese_*` checkpoints) loads with jieba on, as that tokenizer always segments.

    Args:
        vocab: The WordPiece vocabulary, as a `{token: id}` dict or the path of a BERT-style `vocab.txt` (one token
            per line, the line number is the id). Defaults to the special tokens only.
        do_lower_case: Lowercase the text before tokenizing.
        tokenize_chinese_chars: Split Chinese characters apart (with jieba: those of words not in the vocabulary).
        strip_accents: Strip accents; `None` follows `do_lower_case`, as in BERT.
        use_jieba: Segment Chinese words with jieba before WordPiece.
        add_sep_token: End a single text with `[SEP]` (`[CLS] text [SEP]`, the default, which is also how a causal LM
            trained on this tokenizer's output learns where a text ends); `False` gives `[CLS] text`, the form of a
            prompt that a causal LM is to continue. Pairs keep both `[SEP]`s. Default: `True`, except when loading
            from a causal LM's folder (its config.json: `is_decoder` without `prefix_lm`) that records no choice.
        unk_token, sep_token, pad_token, cls_token, mask_token: The special tokens.

    Example:

    ```python
    >>> from roformer_hf import RoFormerHFTokenizer
    >>> vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "rot", "##ary", "!"])}
    >>> tokenizer = RoFormerHFTokenizer(vocab=vocab)
    >>> tokenizer("Rotary!")["input_ids"]
    [2, 5, 6, 7, 3]
    >>> tokenizer.convert_ids_to_tokens(tokenizer("rotary", "rot")["input_ids"])
    ['[CLS]', 'rot', '##ary', '[SEP]', 'rot', '[SEP]']
    ```
    """

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    model = WordPiece

    def __init__(
        self,
        vocab: str | dict[str, int] | None = None,
        do_lower_case: bool = True,
        unk_token: str = "[UNK]",
        sep_token: str = "[SEP]",
        pad_token: str = "[PAD]",
        cls_token: str = "[CLS]",
        mask_token: str = "[MASK]",
        tokenize_chinese_chars: bool = True,
        strip_accents: bool | None = None,
        use_jieba: bool = False,
        add_sep_token: bool | None = None,
        **kwargs,
    ):
        if use_jieba:
            _import_rjieba()  # fail before building anything
        vocab = _resolve_vocab(vocab, kwargs.pop("tokenizer_file", None), special_tokens=(
            pad_token, unk_token, cls_token, sep_token, mask_token))
        self.do_lower_case = do_lower_case
        self.tokenize_chinese_chars = tokenize_chinese_chars
        self.strip_accents = strip_accents
        self.use_jieba = use_jieba
        self._add_sep_token = True if add_sep_token is None else bool(add_sep_token)
        # Recorded always, as transformers records every argument: None (unchosen, so that the folder of a causal LM
        # can default it to False when loaded), True or False.
        kwargs["add_sep_token"] = None if add_sep_token is None else bool(add_sep_token)

        backend = Tokenizer(WordPiece(vocab, unk_token=str(unk_token)))
        backend.normalizer = _normalizer(do_lower_case, strip_accents, tokenize_chinese_chars, use_jieba)
        backend.pre_tokenizer = BertPreTokenizer()
        backend.decoder = decoders.WordPiece(prefix="##")
        self._tokenizer = backend
        super().__init__(
            do_lower_case=do_lower_case,
            unk_token=unk_token,
            sep_token=sep_token,
            pad_token=pad_token,
            cls_token=cls_token,
            mask_token=mask_token,
            tokenize_chinese_chars=tokenize_chinese_chars,
            strip_accents=strip_accents,
            use_jieba=use_jieba,
            **kwargs,
        )
        self._tokenizer.post_processor = self._templates()
        if use_jieba:
            self._attach_jieba()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *init_inputs, **kwargs):
        """transformers' `from_pretrained`; a tokenizer saved by transformers' RoFormer gets `use_jieba=True`, one in
        a causal LM's folder `add_sep_token=False` (prompts to continue) unless it records a choice."""
        if "use_jieba" not in kwargs and _saved_by_transformers_roformer(pretrained_model_name_or_path, kwargs):
            kwargs["use_jieba"] = True
        if kwargs.get("add_sep_token") is None and _beside_a_causal_lm(pretrained_model_name_or_path, kwargs):
            logger.info("%s: the tokenizer of a causal LM: single texts encode as [CLS] text, without [SEP], as "
                        "prompts to continue (pass add_sep_token=True to encode training texts)",
                        pretrained_model_name_or_path)
            kwargs["add_sep_token"] = False
        return super().from_pretrained(pretrained_model_name_or_path, *init_inputs, **kwargs)

    def save_pretrained(self, save_directory, *args, filename_prefix: str | None = None, **kwargs):
        """transformers' `save_pretrained`, with `add_sep_token` written as chosen: null when it never was (transformers
        writes the value of the attribute of that name, the effective True), so that a causal LM's folder still
        defaults it to False when loaded."""
        files = super().save_pretrained(save_directory, *args, filename_prefix=filename_prefix, **kwargs)
        config_file = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") +
                                   "tokenizer_config.json")
        with open(config_file, encoding="utf-8") as handle:
            saved = json.load(handle)
        if saved.get("add_sep_token") != self.init_kwargs.get("add_sep_token"):
            saved["add_sep_token"] = self.init_kwargs.get("add_sep_token")
            with open(config_file, "w", encoding="utf-8") as handle:
                json.dump(saved, handle, indent=2, sort_keys=True, ensure_ascii=False)
                handle.write("\n")
        return files

    @property
    def add_sep_token(self) -> bool:
        """Whether a single text ends with `[SEP]` (see the class's arguments); settable."""
        return self._add_sep_token

    @add_sep_token.setter
    def add_sep_token(self, value: bool) -> None:
        self._add_sep_token = bool(value)
        self.init_kwargs["add_sep_token"] = self._add_sep_token
        self._tokenizer.post_processor = self._templates()

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
                **kwargs) -> str:
        """transformers' decoding, reading ids that do not start with `[CLS]` as the continuation of a text (the
        tokens `generate()` adds, which the text-generation pipeline appends to the prompt): a leading `##` piece
        joins the text before it, and a leading word starts with a space."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = super()._decode(ids, skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        start = next((i for i in ids if i != self.pad_token_id), None)  # after left padding
        first = next((i for i in ids if not (skip_special_tokens and i in self.all_special_ids)), None)
        if start is None or start == self.cls_token_id or first is None or not text:
            return text
        piece = self.convert_ids_to_tokens(first)
        if piece.startswith("##"):
            return text.removeprefix("##")
        # The decoder's clean-up (" ." -> ".", " 's" -> "'s") on the join, as inside a text.
        return text if text.startswith(" ") else self.clean_up_tokenization(f" {text}")

    def _templates(self) -> processors.TemplateProcessing:
        cls, sep = str(self.cls_token), str(self.sep_token)
        return processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0" if self._add_sep_token else f"{cls}:0 $A:0",
            pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, self.cls_token_id), (sep, self.sep_token_id)],
        )

    def _attach_jieba(self) -> None:
        vocab = self._tokenizer.get_vocab(with_added_tokens=False)
        self._tokenizer.pre_tokenizer = PreTokenizer.custom(
            JiebaPreTokenizer(vocab, split_chinese_chars=self.tokenize_chinese_chars)
        )

    @contextmanager
    def _serializable_backend(self) -> Iterator[Tokenizer]:
        """The backend with `BertPreTokenizer` standing in for jieba, which tokenizers cannot serialize."""
        if not self.use_jieba:
            yield self._tokenizer
            return
        self._tokenizer.pre_tokenizer = BertPreTokenizer()
        try:
            yield self._tokenizer
        finally:
            self._attach_jieba()

    def _save_pretrained(self, save_directory, file_names, legacy_format=None, filename_prefix=None):
        with self._serializable_backend():
            file_names = super()._save_pretrained(save_directory, file_names, legacy_format, filename_prefix)
        # vocab.txt too: the layout of the published checkpoints, readable by any BERT-style tokenizer.
        return file_names + self.save_vocabulary(save_directory, filename_prefix)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return tuple(self._tokenizer.model.save(str(save_directory), name=filename_prefix))

    def __getstate__(self) -> dict:
        # pickle (multiprocessing, datasets.map) goes through tokenizer.json, which cannot hold jieba.
        state = self.__dict__.copy()
        with self._serializable_backend() as backend:
            state["_tokenizer"] = Tokenizer.from_str(backend.to_str())
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.use_jieba:
            self._attach_jieba()




def _normalizer(lowercase: bool, strip_accents: bool | None, tokenize_chinese_chars: bool,
                use_jieba: bool) -> normalizers.BertNormalizer:
    return normalizers.BertNormalizer(
        clean_text=True,
        # jieba needs whole words; it splits the characters of unknown words itself.
        handle_chinese_chars=tokenize_chinese_chars and not use_jieba,
        strip_accents=strip_accents,
        lowercase=lowercase,
    )


def _resolve_vocab(vocab: str | dict[str, int] | None, tokenizer_file: str | None,
                   special_tokens: tuple) -> dict[str, int]:
    """The `{token: id}` vocabulary from a dict, a vocab.txt path or a tokenizer.json (in that order)."""
    if isinstance(vocab, dict):
        return vocab
    if isinstance(vocab, str):
        return WordPiece.read_file(vocab)
    if vocab is not None:
        raise ValueError(f"vocab={type(vocab).__name__}: expected a {{token: id}} dict or the path of a vocab.txt")
    if tokenizer_file is not None:
        with open(tokenizer_file, encoding="utf-8") as handle:
            return json.load(handle)["model"]["vocab"]
    return {str(token): index for index, token in enumerate(special_tokens)}


def _beside_a_causal_lm(name, kwargs: dict) -> bool:
    """Whether `name` (a folder or a Hub repository) holds a causal LM (config.json: `is_decoder`, no `prefix_lm`)
    and a tokenizer that records no choice of `add_sep_token` (none, or None)."""
    if os.path.isfile(name):
        return False
    download = {key: kwargs[key] for key in DOWNLOAD_ARGS if kwargs.get(key) is not None}
    if get_tokenizer_config(name, **download).get("add_sep_token") is not None:  # a choice was recorded
        return False
    config_file = cached_file(name, CONFIG_NAME, **download, _raise_exceptions_for_missing_entries=False,
                              _raise_exceptions_for_connection_errors=False)
    if config_file is None:
        return False
    with open(config_file, encoding="utf-8") as handle:
        config = json.load(handle)
    roformer_sim = config.get("model_type") == TRANSFORMERS_MODEL_TYPE and "pooler_activation" in config  # prefix-LM
    return bool(config.get("is_decoder")) and not config.get("prefix_lm") and not roformer_sim


def _saved_by_transformers_roformer(name, kwargs: dict) -> bool:
    """Whether `name` (a folder or a Hub repository) holds a tokenizer saved by transformers' RoFormer tokenizer.

    That tokenizer always segments with jieba but records no `use_jieba`. Its tokenizer_config.json names its class,
    or, in older folders, names none beside the config.json of transformers' RoFormer, whose model type
    AutoTokenizer maps to it. A tokenizer saved by this class records `use_jieba` itself; a bare vocab.txt is BERT's.
    """
    if os.path.isfile(name):  # a vocab.txt given directly
        return False
    download = {key: kwargs[key] for key in DOWNLOAD_ARGS if kwargs.get(key) is not None}
    saved = get_tokenizer_config(name, **download)
    if "use_jieba" in saved:
        return False
    if "tokenizer_class" in saved:
        return saved["tokenizer_class"] in TRANSFORMERS_CLASSES
    config_file = cached_file(name, CONFIG_NAME, **download, _raise_exceptions_for_missing_entries=False,
                              _raise_exceptions_for_connection_errors=False)
    if config_file is None:
        return False
    with open(config_file, encoding="utf-8") as handle:
        return json.load(handle).get("model_type") == TRANSFORMERS_MODEL_TYPE


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    lowercase: bool = True,
    strip_accents: bool | None = None,
    tokenize_chinese_chars: bool = True,
    use_jieba: bool = False,
    min_frequency: int = 2,
    limit_alphabet: int = 1000,
    batch_size: int = 1000,
    show_progress: bool = False,
    **tokenizer_kwargs,
) -> RoFormerHFTokenizer:
    """Train a WordPiece vocabulary on `texts` and return a ready `RoFormerHFTokenizer`.

    `texts` is read once, in batches of `batch_size`, so a generator over a corpus larger than memory works. The
    vocabulary starts with `[PAD] [UNK] [CLS] [SEP] [MASK]` (ids 0 to 4; `RoFormerConfig.pad_token_id` is 0).

    Two trainings on the same texts need not give the same vocabulary: tokenizers' WordPiece trainer numbers the word
    pieces (``##e``) in the order of a hash map, which changes between processes, and where two merges are equally
    frequent the numbers decide. Save the trained tokenizer with the model (`save_pretrained`) rather than training it
    again.

    Args:
        texts: Any iterable of strings (a list, a generator, a `datasets` column).
        vocab_size: The size of the vocabulary, special tokens included; a small corpus may give fewer.
        lowercase, strip_accents, tokenize_chinese_chars, use_jieba: As in `RoFormerHFTokenizer`. With jieba,
            whole jieba words are counted, so frequent Chinese words can enter the vocabulary.
        min_frequency: How often a pair of pieces must occur to be merged.
        limit_alphabet: The most distinct characters to keep.
        batch_size: How many texts to hand to the trainer at a time.
        show_progress: Show the trainer's progress bar.
        **tokenizer_kwargs: Passed to `RoFormerHFTokenizer` (e.g. `model_max_length`).

    Returns:
        The trained tokenizer.

    Example:

    ```python
    >>> from roformer_hf import train_tokenizer
    >>> tokenizer = train_tokenizer(["the rotary encoder", "the rotary position"] * 50, vocab_size=60)
    >>> tokenizer.tokenize("Rotary position")
    ['rotary', 'position']
    ```
    """
    if isinstance(texts, str) or not isinstance(texts, Iterable):
        raise ValueError(f"texts={type(texts).__name__}: expected an iterable of strings (not a single string)")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size!r}: expected an int > {len(SPECIAL_TOKENS)} (the special tokens)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size={batch_size!r}: expected a positive int")

    backend = Tokenizer(WordPiece(unk_token="[UNK]"))
    backend.normalizer = _normalizer(lowercase, strip_accents, tokenize_chinese_chars, use_jieba)
    backend.pre_tokenizer = PreTokenizer.custom(JiebaPreTokenizer(None)) if use_jieba else BertPreTokenizer()
    trainer = WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        limit_alphabet=limit_alphabet,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=show_progress,
        continuing_subword_prefix="##",
    )
    backend.train_from_iterator(_batches(texts, batch_size), trainer=trainer)
    vocab = backend.get_vocab(with_added_tokens=False)
    logger.info("trained a WordPiece vocabulary of %d tokens", len(vocab))
    return RoFormerHFTokenizer(vocab=vocab, do_lower_case=lowercase, strip_accents=strip_accents,
                                 tokenize_chinese_chars=tokenize_chinese_chars, use_jieba=use_jieba,
                                 **tokenizer_kwargs)


def _batches(texts: Iterable[str], batch_size: int) -> Iterator[list[str]]:
    batch = []
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts[{index}]={type(text).__name__}: expected every item to be a str")
        batch.append(text)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


RoFormerHFTokenizer.register_for_auto_class("AutoTokenizer")

__all__ = ["RoFormerHFTokenizer", "train_tokenizer"]


def __getattr__(name: str):
    if name == "RoFormerTokenizerFast":  # the former public name, which is also transformers' RoFormer tokenizer's
        warnings.warn("roformer_hf.RoFormerTokenizerFast is now RoFormerHFTokenizer, the name the tokenizer reports "
                      "and saves; the old name will be removed", FutureWarning, stacklevel=2)
        return RoFormerHFTokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
