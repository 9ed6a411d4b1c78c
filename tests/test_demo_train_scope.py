"""`aligned-ops demo --moe --train-scope head` trains only the weights after the last MoE router, so a weight-lag
step cannot change any token's experts (the demo's aligned D3 then carries the smooth lag only). Checked on a
tiny in-memory Qwen3-MoE: perturbing every selected weight leaves every route unchanged; perturbing a weight the
predicate rejects (the last layer's attention, upstream of its router) flips routes (negative control)."""

import torch

from aligned_ops.runner.learner import downstream_of_last_router, is_router
from aligned_ops.integrations.routing_capture import capture_hf_routing


def tiny_moe(layers=2, tie=True):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from aligned_ops.testing.tiny_model import DEFAULT_MOE_CONFIG

    torch.manual_seed(0)
    cfg = dict(DEFAULT_MOE_CONFIG, num_hidden_layers=layers, tie_word_embeddings=tie, vocab_size=64)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_router(name):
                p.normal_(0, 0.08)  # routers near ties, as in the demo: routes are easy to flip
    return model


def routes(model, ids):
    with torch.no_grad(), capture_hf_routing(model) as rec:
        model(input_ids=ids)
    return torch.stack([r.sort(-1).values for r in rec])


def perturb(model, select):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if select(name):
                p.add_(torch.randn_like(p) * p.detach().abs().mean().clamp_min(0.05))


def test_predicate_selects_exactly_the_weights_after_the_last_router():
    model = tiny_moe(layers=2, tie=False)
    picked = sorted(n for n, _ in model.named_parameters() if downstream_of_last_router(n, 2))
    assert picked == ["lm_head.weight", "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj",
                      "model.norm.weight"]
    tied = tiny_moe(layers=2, tie=True)  # a tied head is the embedding, upstream of every router: not picked
    assert not any(downstream_of_last_router(n, 2) and "embed" in n for n, _ in tied.named_parameters())


def test_training_the_head_cannot_flip_a_route():
    ids = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(1))
    for layers in (1, 2):
        model = tiny_moe(layers=layers, tie=False)
        before = routes(model, ids)
        perturb(model, lambda n: downstream_of_last_router(n, layers))
        assert torch.equal(routes(model, ids), before)
        # Negative control: the last layer's attention feeds its router; perturbing it moves routes.
        perturb(model, lambda n: f"layers.{layers - 1}.self_attn." in n)
        assert not torch.equal(routes(model, ids), before)
