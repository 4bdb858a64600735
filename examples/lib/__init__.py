"""What the example scripts share and import, never run on their own: the built-in Shakespeare data
(`shakespeare`), the MLM collators (`collator`), the offline classification metric (`classification_metric`), the
bag-of-words baseline (`baseline`), and the scripts' argument handling (`example_utils`, `config_overrides`).
A script imports them as ``from lib.shakespeare import ...`` (its own folder, examples/, is on ``sys.path``)."""
