"""torchplex: native-PyTorch GRPO post-training of Qwen2.5-VL."""

from .components.console import quiet_third_party_imports

quiet_third_party_imports()  # before anything imports transformers (which imports torchao when installed)
