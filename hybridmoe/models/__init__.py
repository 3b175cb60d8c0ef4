"""Model families: the shared decoder (base.py) and one ArchSpec builder per architecture.

The built-in architectures are registered here by their `config.architectures` name and imported
on first use (models/registry.py imports none of them).
"""

from hybridmoe.models.registry import ARCHITECTURES

ARCHITECTURES.register("DeepseekV2ForCausalLM", "hybridmoe.models.deepseek:deepseek_v2_spec")
ARCHITECTURES.register("DeepseekV3ForCausalLM", "hybridmoe.models.deepseek:deepseek_v3_spec")
ARCHITECTURES.register("MixtralForCausalLM", "hybridmoe.models.mixtral:mixtral_spec")
ARCHITECTURES.register("Qwen2MoeForCausalLM", "hybridmoe.models.qwen2_moe:qwen2_moe_spec")
ARCHITECTURES.register("Qwen3MoeForCausalLM", "hybridmoe.models.qwen3_moe:qwen3_moe_spec")
