"""Image features written over placeholder embeddings: the same values and gradients as masked_scatter."""

from __future__ import annotations

import torch

from gymv.backends.hf_forward import embed_with_images

IMAGE = 5


class _Embedder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)

    def get_input_embeddings(self):
        return self.embed


def _case():
    torch.manual_seed(0)
    model = _Embedder()
    ids = torch.tensor([[1, IMAGE, IMAGE, IMAGE, 2, 3], [IMAGE, IMAGE, 4, 1, IMAGE, 6]])
    feats = [torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)]
    return model, ids, feats


def test_features_land_on_the_placeholders_in_order_exactly_as_masked_scatter_puts_them():
    model, ids, feats = _case()
    expected = model.embed(ids).masked_scatter((ids == IMAGE).unsqueeze(-1), torch.cat(feats))
    assert torch.equal(embed_with_images(model, ids, IMAGE, feats), expected)


def test_gradients_reach_features_and_embeddings_as_through_masked_scatter():
    model, ids, feats = _case()
    weight = torch.randn(2, 6, 8)
    out = embed_with_images(model, ids, IMAGE, feats)
    ref = model.embed(ids).masked_scatter((ids == IMAGE).unsqueeze(-1), torch.cat(feats))
    got = torch.autograd.grad((out * weight).sum(), [*feats, model.embed.weight])
    want = torch.autograd.grad((ref * weight).sum(), [*feats, model.embed.weight])
    assert all(torch.allclose(a, b) for a, b in zip(got, want))


def test_a_row_without_images_keeps_its_token_embeddings():
    model, _, _ = _case()
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(embed_with_images(model, ids, IMAGE, []), model.embed(ids))
