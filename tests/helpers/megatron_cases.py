"""The Megatron-LM checkpoints tests/writers/megatron_checkpoint.py writes for the suite (conftest's megatron_root):
name -> the writer's case spec."""

CASES = {
    "tp2_gqa_bias": "arch=qwen2,tp=2",  # Qwen2: qkv bias, 4 heads in 2 groups, split over 2 TP ranks
    "tp2_pp2_vpp2_tied": "arch=llama,tp=2,pp=2,vpp=2,layers=4,tied=1",  # vocab 101 padded to 256
    "moe_tp2_ep2": "arch=qwen2_moe,tp=2,ep=2",  # 4 experts over 2 EP ranks, shared expert with its gate
    "qwen3_mqa_pp2": "arch=qwen3,pp=2,groups=1,layers=4",  # q/k norms; one query group (groups % TP == 0)
    "mistral_tp2": "arch=mistral,tp=2",  # Llama's layout under Mistral's model_type
    "mixtral_ep2": "arch=mixtral,ep=2",  # `mp_rank_00_001` is EP here, not PP: the saved args decide
    "qwen3_moe_tp2": "arch=qwen3_moe,tp=2",
    "critic_tp2": "arch=qwen2,tp=2,value=1",  # verl's critic: a replicated Linear(hidden, 1) head
    "optim_only": "optim_only=1",  # a torch_dist save holding no model tensors
}
