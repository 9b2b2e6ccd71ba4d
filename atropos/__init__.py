"""atropos-sandbox: isolated, stateful sandbox slots for RL of tool-using LLM agents."""

import os as _os

# transformers prints "None of PyTorch, TensorFlow >= 2.0, or Flax have been found..." at import when
# no framework is installed, and this project needs none (tokenizers only). It is an "advisory"
# warning, which transformers skips when this variable is set; a user who sets it to "" sees it again.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"
