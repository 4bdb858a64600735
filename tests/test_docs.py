"""The runnable examples in the docstrings of the public classes run and print what they say."""

import doctest
import re

import pytest

import roformer_hf

PUBLIC = [roformer_hf.RoFormerConfig, *(head.model_class for head in roformer_hf.modeling.HEADS)]


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda cls: cls.__name__)
def test_docstring_example_runs(cls):
    blocks = re.findall(r"```python\n(.*?)```", cls.__doc__ or "", flags=re.DOTALL)
    assert blocks, f"{cls.__name__} has no runnable example"
    test = doctest.DocTestParser().get_doctest("".join(blocks), {}, cls.__name__, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
