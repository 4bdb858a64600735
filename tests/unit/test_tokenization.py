"""Tests of roformer_hf.tokenization against transformers' BERT and RoFormer tokenizers on the same vocab.txt."""

import itertools
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap

import pytest
import transformers
from helpers import BLOCK_ROFORMER_HF, ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roformer_hf import RoFormerConfig, RoFormerHFTokenizer, RoFormerModel, train_tokenizer
from roformer_hf.tokenization import _batches

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ENGLISH = ["hello", "world", "rotary", "position", "embedding", "use", "ro", "##former", "##s", "##ing", "2024"]
CHINESE_WORDS = ["今天", "天气", "非常", "我们", "喜欢", "北京", "上海", "学习", "机器", "模型", "中文", "训练", "预训练",
                 "你好", "世界", "一个"]
PUNCTUATION = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + list("，。：“”！？、（）")
UNKNOWN_CHAR = "龘"  # a Chinese character left out of the vocabulary

SENTENCES = [
    "今天天气非常好。",
    "我们喜欢在北京学习机器学习模型。",
    "RoFormer是一个中文预训练模型，use rotary position embedding!",
    "他说：“你好，世界”",
    "Héllo WORLD 2024年12月",
    f"不在词表里的字：{UNKNOWN_CHAR}{UNKNOWN_CHAR}",
    "  北京   上海 \t 学习\n",
    "hellos, worlds; rotating positions",
]


def _chinese_chars() -> list[str]:
    seen = dict.fromkeys(ch for text in SENTENCES + CHINESE_WORDS for ch in text if "\u4e00" <= ch <= "\u9fff")
    seen.pop(UNKNOWN_CHAR)
    return list(seen)


def _vocab_tokens() -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    tokens = SPECIALS + PUNCTUATION + list(letters) + [f"##{c}" for c in letters] + ENGLISH
    tokens += _chinese_chars() + CHINESE_WORDS
    return list(dict.fromkeys(tokens))


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    """A folder holding only a BERT-style vocab.txt, the layout of the published RoFormer checkpoints."""
    folder = tmp_path_factory.mktemp("vocab")
    (folder / "vocab.txt").write_text("\n".join(_vocab_tokens()) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def vocab(vocab_dir):
    return {token: index for index, token in enumerate(_vocab_tokens())}


@pytest.fixture(scope="module")
def bert_tokenizer(vocab):
    return transformers.BertTokenizer(vocab=vocab)


@pytest.fixture(scope="module")
def reference_jieba_tokenizer(vocab):
    # Built from a dict: transformers 5.23's RoFormerTokenizer.from_pretrained(folder) hands the vocab.txt *path*
    # to its jieba pre-tokenizer, whose `word in vocab` then tests substrings of the path.
    return transformers.RoFormerTokenizer(vocab=vocab)


@pytest.fixture(scope="module")
def tokenizer(vocab_dir):
    return RoFormerHFTokenizer.from_pretrained(vocab_dir)


@pytest.fixture(scope="module")
def jieba_tokenizer(vocab_dir):
    return RoFormerHFTokenizer.from_pretrained(vocab_dir, use_jieba=True)


def _ids(tokenizer, texts=SENTENCES) -> list[list[int]]:
    return tokenizer(texts)["input_ids"]


# --- vocab.txt, special tokens, templates --------------------------------------------------------------------------

def test_vocab_txt_loads_with_ids_by_line(tokenizer):
    assert tokenizer.get_vocab() == {token: index for index, token in enumerate(_vocab_tokens())}
    assert [tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id,
            tokenizer.mask_token_id] == [0, 1, 2, 3, 4]
    assert tokenizer.model_input_names == ["input_ids", "token_type_ids", "attention_mask"]


@pytest.mark.parametrize("options", [{}, {"do_lower_case": False}, {"strip_accents": False},
                                     {"tokenize_chinese_chars": False}])
def test_matches_bert_on_the_same_vocab(vocab_dir, vocab, options):
    ours = RoFormerHFTokenizer.from_pretrained(vocab_dir, **options)
    reference = transformers.BertTokenizer(vocab=vocab, **options)
    for first, second in zip(SENTENCES, SENTENCES[1:] + SENTENCES[:1]):
        got = ours(first, second, return_offsets_mapping=True)
        expected = reference(first, second, return_offsets_mapping=True, return_token_type_ids=True)
        for key in ("input_ids", "token_type_ids", "attention_mask", "offset_mapping"):
            assert got[key] == expected[key], (key, first, second)


def test_options_change_the_ids(vocab_dir):
    lower = RoFormerHFTokenizer.from_pretrained(vocab_dir)
    cased = RoFormerHFTokenizer.from_pretrained(vocab_dir, do_lower_case=False)
    assert lower.tokenize("Héllo") == ["hello"]
    assert cased.tokenize("Héllo") == ["[UNK]"]  # "H" and "é" are not in the vocabulary
    keep_accents = RoFormerHFTokenizer.from_pretrained(vocab_dir, strip_accents=False)
    assert keep_accents.tokenize("héllo") == ["[UNK]"]
    whole = RoFormerHFTokenizer.from_pretrained(vocab_dir, tokenize_chinese_chars=False)
    assert whole.tokenize("北京 北上") == ["北京", "[UNK]"]  # "北上" is one word, and "##上" is not in the vocabulary
    assert lower.tokenize("北京 北上") == ["北", "京", "北", "上"]


def test_pair_layout_and_token_types(tokenizer):
    first, second = "hello world", "rotary position"
    encoded = tokenizer(first, second)
    a, b = tokenizer.encode(first, add_special_tokens=False), tokenizer.encode(second, add_special_tokens=False)
    assert encoded["input_ids"] == [2, *a, 3, *b, 3]
    assert encoded["token_type_ids"] == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    assert tokenizer(first)["input_ids"] == [2, *a, 3]
    assert tokenizer(first)["token_type_ids"] == [0] * (len(a) + 2)


def test_padding_uses_pad_id_zero(tokenizer):
    batch = tokenizer(["hello", "hello rotary world"], padding=True)
    assert batch["input_ids"][0][-2:] == [0, 0]
    assert batch["attention_mask"][0] == [1, 1, 1, 0, 0]


def test_unknown_words(tokenizer):
    assert tokenizer.tokenize(f"hello {UNKNOWN_CHAR} zebra") == ["hello", "[UNK]", "z", "##e", "##b", "##r", "##a"]
    assert tokenizer.tokenize("zebra✓") == ["[UNK]"]  # "✓" is no punctuation: the whole word has no pieces
    assert tokenizer.tokenize("rotarys roformer") == ["rotary", "##s", "ro", "##former"]
    ids = tokenizer(f"{UNKNOWN_CHAR}!")["input_ids"]
    assert ids == [2, 1, tokenizer.convert_tokens_to_ids("!"), 3]


def test_offsets_point_into_the_original_text(tokenizer, jieba_tokenizer):
    text = "Héllo 北京 world"
    for tok in (tokenizer, jieba_tokenizer):
        encoded = tok(text, return_offsets_mapping=True, add_special_tokens=False)
        pieces = [text[start:end] for start, end in encoded["offset_mapping"]]
        assert pieces == ["Héllo", "北京" if tok.use_jieba else "北", *([] if tok.use_jieba else ["京"]), "world"]


def test_decode_round_trip(tokenizer):
    text = "hello rotary position embedding"
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text


# --- jieba ---------------------------------------------------------------------------------------------------------

def test_jieba_matches_transformers_roformer(jieba_tokenizer, reference_jieba_tokenizer):
    for first, second in zip(SENTENCES, SENTENCES[1:] + SENTENCES[:1]):
        got = jieba_tokenizer(first, second, return_offsets_mapping=True)
        expected = reference_jieba_tokenizer(first, second, return_offsets_mapping=True, return_token_type_ids=True)
        for key in ("input_ids", "token_type_ids", "offset_mapping"):
            assert got[key] == expected[key], (key, first, second)


def test_jieba_keeps_vocabulary_words_whole(jieba_tokenizer, tokenizer):
    assert jieba_tokenizer.tokenize("我们喜欢北京") == ["我们", "喜欢", "北京"]
    assert tokenizer.tokenize("我们喜欢北京") == ["我", "们", "喜", "欢", "北", "京"]
    # jieba reads "今天天气" as one word; it is not in the vocabulary, so it falls back to characters.
    assert jieba_tokenizer.tokenize("今天天气") == ["今", "天", "天", "气"]


CHINESE_ALPHABET = _chinese_chars() + list("abcz ,.!，。") + [UNKNOWN_CHAR, "\t", "É"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(CHINESE_ALPHABET), max_size=30))
def test_jieba_matches_transformers_roformer_on_random_text(jieba_tokenizer, reference_jieba_tokenizer, text):
    got = jieba_tokenizer(text, return_offsets_mapping=True)
    expected = reference_jieba_tokenizer(text, return_offsets_mapping=True)
    assert got["input_ids"] == expected["input_ids"]
    assert got["offset_mapping"] == expected["offset_mapping"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(CHINESE_ALPHABET + list("ÄéHW-'")), max_size=30))
def test_matches_bert_on_random_text(tokenizer, bert_tokenizer, text):
    got = tokenizer(text, return_offsets_mapping=True)
    expected = bert_tokenizer(text, return_offsets_mapping=True)
    assert got["input_ids"] == expected["input_ids"]
    assert got["offset_mapping"] == expected["offset_mapping"]


def test_missing_rjieba_names_the_extra(vocab, monkeypatch):
    monkeypatch.setitem(sys.modules, "rjieba", None)  # makes `import rjieba` raise ImportError
    with pytest.raises(ImportError, match=r"pip install roformer_hf\[chinese\]"):
        RoFormerHFTokenizer(vocab=vocab, use_jieba=True)
    with pytest.raises(ImportError, match=r"roformer_hf\[chinese\]"):
        train_tokenizer(["北京"] * 10, vocab_size=20, use_jieba=True)
    assert RoFormerHFTokenizer(vocab=vocab).tokenize("北京") == ["北", "京"]  # jieba stays optional


def test_jieba_survives_pickle(jieba_tokenizer):
    restored = pickle.loads(pickle.dumps(jieba_tokenizer))
    assert restored.use_jieba
    assert _ids(restored) == _ids(jieba_tokenizer)
    assert jieba_tokenizer.tokenize("北京") == ["北京"]  # pickling swapped the pre-tokenizer back


# --- save / load ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_jieba", [False, True])
def test_ids_equal_after_save_and_load(vocab_dir, tmp_path, use_jieba):
    tokenizer = RoFormerHFTokenizer.from_pretrained(vocab_dir, use_jieba=use_jieba, do_lower_case=False)
    tokenizer.save_pretrained(tmp_path)
    reloaded = RoFormerHFTokenizer.from_pretrained(tmp_path)
    assert (reloaded.use_jieba, reloaded.do_lower_case) == (use_jieba, False)
    assert _ids(reloaded) == _ids(tokenizer)
    assert reloaded("今天", "北京")["token_type_ids"] == tokenizer("今天", "北京")["token_type_ids"]
    assert (tmp_path / "vocab.txt").read_text(encoding="utf-8") == (vocab_dir / "vocab.txt").read_text(encoding="utf-8")
    assert tokenizer.tokenize("我们") == (["我们"] if use_jieba else ["我", "们"])  # saving restored jieba


def test_saved_config_carries_jieba_and_the_remote_code_entry(jieba_tokenizer, tmp_path):
    jieba_tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["use_jieba"] is True
    assert config["auto_map"] == {"AutoTokenizer": ["tokenization.RoFormerHFTokenizer", None]}
    # Our class's own name: "RoFormerTokenizer" would resolve to transformers' tokenizer.
    assert config["tokenizer_class"] == RoFormerHFTokenizer.__name__ == "RoFormerHFTokenizer"
    assert (tmp_path / "tokenization.py").is_file()
    # tokenizer.json cannot hold a Python pre-tokenizer: BERT's stands in for jieba.
    saved_backend = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert saved_backend["pre_tokenizer"]["type"] == "BertPreTokenizer"


def _tiny_config(vocab_size: int) -> RoFormerConfig:
    return RoFormerConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=64)


def test_auto_tokenizer_in_process(jieba_tokenizer, tmp_path):
    _tiny_config(len(jieba_tokenizer)).save_pretrained(tmp_path)
    jieba_tokenizer.save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded) is RoFormerHFTokenizer
    assert _ids(loaded) == _ids(jieba_tokenizer)


REMOTE_SCRIPT = BLOCK_ROFORMER_HF + textwrap.dedent("""
    import json, sys
    from transformers import AutoTokenizer

    folders, texts = json.loads(sys.argv[1])
    result = []
    for folder in folders:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        result.append({"module": type(tokenizer).__module__, "use_jieba": tokenizer.use_jieba,
                       "ids": tokenizer(texts)["input_ids"], "pair": dict(tokenizer(texts[0], texts[1]))})
    assert not [name for name, module in sys.modules.items() if name.split(".")[0] == "roformer_hf" and module]
    print(json.dumps(result))
""")


def test_auto_tokenizer_remote_code_without_roformer_hf(tokenizer, jieba_tokenizer, tmp_path):
    # A tokenizer-only folder, and a model folder (config.json whose AutoConfig is remote code too).
    tokenizer.save_pretrained(tmp_path / "plain")
    RoFormerModel(_tiny_config(len(jieba_tokenizer))).save_pretrained(tmp_path / "jieba")
    jieba_tokenizer.save_pretrained(tmp_path / "jieba")
    folders = [str(tmp_path / "plain"), str(tmp_path / "jieba")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "PYTHONPATH": ""}
    completed = subprocess.run([sys.executable, "-c", REMOTE_SCRIPT, json.dumps([folders, SENTENCES])],
                               capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert completed.returncode == 0, completed.stderr
    plain, jieba = json.loads(completed.stdout.strip().splitlines()[-1])
    for remote, local in ((plain, tokenizer), (jieba, jieba_tokenizer)):
        assert remote["module"].startswith("transformers_modules.")
        assert remote["use_jieba"] == local.use_jieba
        assert remote["ids"] == _ids(local)
        assert remote["pair"] == dict(local(SENTENCES[0], SENTENCES[1]))


# --- tokenizers of transformers' RoFormer (the published junnyu/roformer_chinese_* checkpoints) ----------------------

def _written_by_transformers(vocab, folder, layout: str):
    """A tokenizer folder of transformers' RoFormer, which always segments with jieba, in one of its layouts:
    "tokenizer.json" as transformers 5 saves it; "vocab.txt" as transformers 4 saved the published checkpoints (a
    tokenizer_config.json naming RoFormerTokenizer); "unnamed": no tokenizer class named, but the config.json of
    transformers' RoFormer beside it (AutoTokenizer maps its model type to RoFormerTokenizer)."""
    transformers.RoFormerTokenizer(vocab=vocab).save_pretrained(folder)
    if layout == "tokenizer.json":
        return folder
    (folder / "tokenizer.json").unlink()
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")  # dicts keep the id order
    if layout == "unnamed":
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
        del config["tokenizer_class"]
        config_file.write_text(json.dumps(config), encoding="utf-8")
        transformers.RoFormerConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=64).save_pretrained(folder)
    return folder


TRANSFORMERS_LAYOUTS = ["tokenizer.json", "vocab.txt", "unnamed"]


@pytest.mark.parametrize("layout", TRANSFORMERS_LAYOUTS)
def test_transformers_roformer_folder_loads_with_jieba(vocab, reference_jieba_tokenizer, tmp_path, layout):
    folder = _written_by_transformers(vocab, tmp_path, layout)
    ours = RoFormerHFTokenizer.from_pretrained(folder)
    assert ours.use_jieba
    assert ours.tokenize("我们喜欢北京") == ["我们", "喜欢", "北京"]
    for first, second in zip(SENTENCES, SENTENCES[1:] + SENTENCES[:1]):
        got = ours(first, second, return_offsets_mapping=True)
        expected = reference_jieba_tokenizer(first, second, return_offsets_mapping=True, return_token_type_ids=True)
        for key in ("input_ids", "token_type_ids", "offset_mapping"):
            assert got[key] == expected[key], (key, first, second)
    # An explicit choice still wins.
    assert RoFormerHFTokenizer.from_pretrained(folder, use_jieba=False).tokenize("我们") == ["我", "们"]


def test_transformers_roformer_folder_through_our_save_and_auto_tokenizer(vocab, reference_jieba_tokenizer, tmp_path):
    """Load transformers' folder with our class, save it beside our model's config: AutoTokenizer gives our class,
    jieba on, the ids of transformers' tokenizer."""
    folder = _written_by_transformers(vocab, tmp_path / "transformers", "vocab.txt")
    RoFormerHFTokenizer.from_pretrained(folder).save_pretrained(tmp_path / "ours")
    _tiny_config(len(vocab)).save_pretrained(tmp_path / "ours")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "ours")
    assert type(loaded) is RoFormerHFTokenizer and loaded.use_jieba
    assert _ids(loaded) == _ids(reference_jieba_tokenizer)


def test_transformers_roformer_folder_without_rjieba_names_the_extra(vocab, tmp_path, monkeypatch):
    folder = _written_by_transformers(vocab, tmp_path, "tokenizer.json")
    monkeypatch.setitem(sys.modules, "rjieba", None)
    with pytest.raises(ImportError, match=r"pip install roformer_hf\[chinese\]"):
        RoFormerHFTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("beside", [None, "transformers' config"])
@pytest.mark.parametrize("use_jieba", [False, True])
def test_auto_tokenizer_in_process_by_the_saved_class_name(vocab_dir, tmp_path, use_jieba, beside):
    """No config.json (or transformers' RoFormer config): the saved tokenizer_config.json names our class, which
    AutoTokenizer finds registered by `import roformer_hf`, without remote code."""
    tokenizer = RoFormerHFTokenizer.from_pretrained(vocab_dir, use_jieba=use_jieba)
    tokenizer.save_pretrained(tmp_path)
    if beside:
        transformers.RoFormerConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=64).save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded) is RoFormerHFTokenizer and loaded.use_jieba == use_jieba
    assert _ids(loaded) == _ids(tokenizer)


# --- training ------------------------------------------------------------------------------------------------------

SYLLABLES = ["ro", "ta", "ry", "po", "si", "tion", "em", "bed", "ding", "trans", "for", "mer", "en", "co", "der",
             "at", "ten", "lay", "er", "to", "ken", "ize", "ma", "ski", "ng"]


def _corpus(lines: int, seed: int = 0):
    """A generator of `lines` lines of pseudo-words (deterministic), never a list."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 3))) for _ in range(400)]
    for _ in range(lines):
        yield " ".join(rng.choices(words, k=12)).capitalize() + "."


def test_train_tokenizer_streams_a_generator(tmp_path):
    tokenizer = train_tokenizer(_corpus(3000), vocab_size=300)
    assert len(tokenizer) == 300
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3, 4]) == SPECIALS
    assert tokenizer.model_input_names == ["input_ids", "token_type_ids", "attention_mask"]
    line = next(_corpus(1, seed=1))
    encoded = tokenizer(line, "rotary")
    assert tokenizer.unk_token_id not in encoded["input_ids"]
    assert encoded["input_ids"][0] == 2 and encoded["input_ids"][-1] == 3
    assert tokenizer.decode(encoded["input_ids"], skip_special_tokens=True) == line.lower() + " rotary"
    # The trained tokenizer is BERT on its own vocabulary.
    reference = transformers.BertTokenizer(vocab=tokenizer.get_vocab())
    assert tokenizer(line, "rotary")["input_ids"] == reference(line, "rotary")["input_ids"]
    tokenizer.save_pretrained(tmp_path)
    assert _ids(RoFormerHFTokenizer.from_pretrained(tmp_path), [line]) == _ids(tokenizer, [line])


def test_training_reads_texts_lazily_in_batches():
    # An endless stream: building a list of it first would never return.
    batches = _batches(itertools.repeat("text"), batch_size=3)
    assert list(itertools.islice(batches, 2)) == [["text"] * 3] * 2
    assert list(_batches(iter(["a", "b"]), batch_size=3)) == [["a", "b"]]


def test_train_tokenizer_with_jieba_learns_words():
    rng = random.Random(0)
    lines = ("".join(rng.choices(CHINESE_WORDS + ["的", "了", "很"], k=8)) + "。" for _ in range(2000))
    tokenizer = train_tokenizer(lines, vocab_size=150, use_jieba=True)
    assert tokenizer.use_jieba
    assert tokenizer.tokenize("我们喜欢北京的天气。") == ["我们", "喜欢", "北京", "的", "天气", "。"]
    assert tokenizer.tokenize("北们") == ["北", "们"]  # not a word: back to characters


@pytest.mark.parametrize("texts, vocab_size, argument", [
    (["a b"], 5, "vocab_size"),
    (["a b"], "100", "vocab_size"),
    (["a b"], True, "vocab_size"),
    ("a single string", 100, "texts"),
    (42, 100, "texts"),
    (["fine", 3], 100, "texts"),
])
def test_train_tokenizer_rejects_bad_arguments(texts, vocab_size, argument):
    with pytest.raises(ValueError, match=argument):
        train_tokenizer(texts, vocab_size)


def test_one_name_in_the_docs_the_code_and_the_saved_folder(tokenizer, tmp_path):

    import roformer_hf

    ours = type(tokenizer).__name__
    assert ours == RoFormerHFTokenizer.__name__ == "RoFormerHFTokenizer"
    assert repr(tokenizer).startswith(ours)
    tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == ours
    assert type(transformers.AutoTokenizer.from_pretrained(tmp_path)).__name__ == ours
    # Every tokenizer class the docs name as roformer_hf's is that one (transformers' own are RoFormerTokenizer and,
    # before transformers 5, RoFormerTokenizerFast, named with "transformers'" before them).
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in page.read_text().splitlines():
            if "roformer_hf.RoFormerTokenizerFast" in line or "from roformer_hf import" in line and \
                    "RoFormerTokenizerFast" in line:
                raise AssertionError(f"{page.name} names the tokenizer RoFormerTokenizerFast: {line}")
    assert "RoFormerTokenizerFast" not in roformer_hf.__all__
    with pytest.warns(FutureWarning, match="now RoFormerHFTokenizer"):
        assert roformer_hf.RoFormerTokenizerFast is RoFormerHFTokenizer  # the former name, still importable


def test_every_argument_with_a_default_is_recorded_as_transformers_tests_it(vocab_dir, tmp_path):
    import inspect

    # transformers' `test_tokenizer_store_full_signature`, with its list of arguments it does not ask for.
    files = {"vocab_file", "merges_file", "tokenizer_file", "vocab", "merges", "legacy", "_spm_precompiled_charsmap",
             "additional_special_tokens"}
    defaults = [name for name, parameter in inspect.signature(RoFormerHFTokenizer.__init__).parameters.items()
                if parameter.default is not inspect.Parameter.empty and name not in files]
    for choice in (None, True, False):  # three values, each kept through a save
        tokenizer = RoFormerHFTokenizer(vocab=str(vocab_dir / "vocab.txt"), add_sep_token=choice)
        assert [name for name in defaults if name not in tokenizer.init_kwargs] == []
        tokenizer.save_pretrained(tmp_path / str(choice))
        saved = json.loads((tmp_path / str(choice) / "tokenizer_config.json").read_text())
        assert saved["add_sep_token"] == choice
        reloaded = RoFormerHFTokenizer.from_pretrained(tmp_path / str(choice))
        assert reloaded.init_kwargs["add_sep_token"] == choice and reloaded.add_sep_token == (choice is not False)
