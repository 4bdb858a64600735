"""transformers' own model tests (`ModelTesterMixin`) on every roformer_hf model (`modeling.HEADS`), all built from
one config, as transformers tests its RoFormer.

`ModelTesterMixin` comes from transformers' source distribution on PyPI (`tests/support/transformers_tests.py` fetches it once
into `.transformers-tests/`); without it, this module is skipped, saying why. The tests it cannot pass by design are
skipped by name below, each with its reason (docs/migrating.md lists them).
"""

from __future__ import annotations

import unittest

import pytest
import transformers_tests

from roformer_hf import RoFormerConfig
from roformer_hf.modeling import HEADS

try:
    common = transformers_tests.import_common()
except (RuntimeError, ImportError, OSError) as error:
    pytest.skip(f"transformers' tests/test_modeling_common.py is not available ({error})", allow_module_level=True)

ModelTesterMixin, ids_tensor, random_attention_mask = common.ModelTesterMixin, common.ids_tensor, \
    common.random_attention_mask


class RoFormerModelTester:
    """Small config and inputs for every head, in the shape of transformers' `RoFormerModelTester`."""

    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, use_input_mask=True,
                 use_token_type_ids=True, use_labels=True, vocab_size=99, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=37, hidden_act="gelu", hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=16,
                 type_sequence_label_size=2, initializer_range=0.02, num_labels=3, num_choices=4):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.use_input_mask = use_input_mask
        self.use_token_type_ids = use_token_type_ids
        self.use_labels = use_labels
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.type_sequence_label_size = type_sequence_label_size
        self.initializer_range = initializer_range
        self.num_labels = num_labels
        self.num_choices = num_choices

    def get_config(self) -> RoFormerConfig:
        return RoFormerConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act, hidden_dropout_prob=self.hidden_dropout_prob,
            attention_probs_dropout_prob=self.attention_probs_dropout_prob,
            max_position_embeddings=self.max_position_embeddings, type_vocab_size=self.type_vocab_size,
            is_decoder=False, initializer_range=self.initializer_range, num_labels=self.num_labels)

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = random_attention_mask([self.batch_size, self.seq_length]) if self.use_input_mask else None
        token_type_ids = (ids_tensor([self.batch_size, self.seq_length], self.type_vocab_size)
                          if self.use_token_type_ids else None)
        sequence_labels = token_labels = choice_labels = None
        if self.use_labels:
            sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
            token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
            choice_labels = ids_tensor([self.batch_size], self.num_choices)
        return (self.get_config(), input_ids, token_type_ids, input_mask, sequence_labels, token_labels,
                choice_labels)

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, token_type_ids, input_mask, *_ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": input_mask}


# Tests that cannot pass by design, and why (docs/migrating.md, "transformers' model tests").
REFUSALS = {
    "test_model_weights_reload_no_missing_tied_weights":
        "loads a folder whose weights were all deleted; roformer_hf refuses a checkpoint that lacks encoder weights "
        "(the model would be half random) unless allow_missing_encoder_weights=True",
    "test_generation_tester_mixin_inheritance":
        "GenerationTesterMixin lives in transformers' tests/generation/test_utils.py, which its sdist does not ship; "
        "generation is compared with transformers' RoFormerForCausalLM in test_decoder.py instead",
}


class RoFormerTransformersSuiteTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = tuple(head.model_class for head in HEADS)

    def setUp(self):
        self.model_tester = RoFormerModelTester(self)
        if reason := REFUSALS.get(self._testMethodName):
            self.skipTest(reason)
