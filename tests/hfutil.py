"""A tiny Hugging Face model and dataset for the tests that run a real Trainer."""

from __future__ import annotations


def tiny_gpt2():
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16))


def tiny_tokens():
    """64 sequences of 8 token ids, labels = inputs."""
    import torch

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.tensor([(i + k) % 50 for k in range(8)])
            return {"input_ids": ids, "labels": ids}

    return Tokens()
