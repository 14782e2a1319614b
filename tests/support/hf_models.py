"""Random-weight transformers models: the references our runtime is held to
(tests/models/test_parity.py) and the checkpoints the fused CPU layer loads
(tests/kernels/test_fused_cpu.py)."""

import torch


def random_hf_model(case: str, cases: dict):
    """`cases[case]` (a transformers class, its config) as a model with every
    weight random and large enough to matter (biases and norms included: they
    start at 0 and 1)."""
    cls, config = cases[case]
    torch.manual_seed(sum(map(ord, case)))
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.1 if name.endswith(("bias", "norm.weight")) else 0.08)
            if name.endswith("norm.weight") and not name.split(".")[-3:][0].startswith("q"):
                p.add_(1.0 if "Gemma" not in cls.__name__ else 0.0)  # Gemma's norms scale by 1 + w
    return model
