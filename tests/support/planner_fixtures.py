"""Tiny model configs and a test machine profile shared by the planner tests (slow links and fast compute,
so communication and memory decide between layouts)."""

from specforge_csbp.planner.profile import MachineProfile

LM = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
      "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
      "vocab_size": 1000, "tie_word_embeddings": True}  # fmt: skip
DRAFTER = {"architectures": ["DFlashDraftModel"], "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "vocab_size": 1000, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 256,
           "dflash_config": {"target_layer_ids": [1, 3, 5]}}  # fmt: skip
PROFILE = MachineProfile(device="test-gpu", date="2025-11-30", world_size=2, gemm_tflops=0.5, attn_tflops=0.2,
                         allgather_gbps=0.05, reduce_scatter_gbps=0.05, allreduce_gbps=0.05,
                         launch_overhead_us=1.0, gpus_per_node=4, internode_gbps=0.01)  # fmt: skip
