"""Sparse gradients: amp.initialize refuses embeddings built with sparse=True, naming the
parameter and the fix, before it changes anything; the fix (dense gradients) trains."""
import pytest
import torch
import torch.nn as nn

from apex_lite import amp

LEVELS = ["O0", "O1", "O2", "O3"]


class Bag(nn.Module):
    """Token ids -> an embedding (or embedding bag), averaged, -> a linear head."""

    def __init__(self, sparse: bool, bag: bool = False):
        super().__init__()
        self.bag = bag
        self.tokens = (nn.EmbeddingBag(50, 8, mode="mean", sparse=sparse) if bag
                       else nn.Embedding(50, 8, sparse=sparse))
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        features = self.tokens(ids) if self.bag else self.tokens(ids).mean(dim=1)
        return self.head(features)


def _batch():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(50, (16, 5), generator=generator)
    return ids, (ids.float().mean(dim=1, keepdim=True) / 50)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bag", [False, True])
def test_sparse_embedding_is_refused_with_its_name_and_the_fix(level, bag):
    model = nn.Sequential(Bag(sparse=True, bag=bag))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kind = "EmbeddingBag" if bag else "Embedding"
    with pytest.raises(ValueError, match=rf"'0\.tokens\.weight' of model 0 belongs to {kind}\(\.\.\., "
                                         rf"sparse=True\).*Build it with sparse=False"):
        amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    # Refused before anything changed: still fp32, same values, forward not wrapped.
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v)
               for k, v in before.items())
    assert "forward" not in vars(model)
    amp.initialize(nn.Linear(2, 2), verbosity=0)   # the handle is still usable


def test_the_model_index_is_named_among_several():
    dense, sparse = Bag(sparse=False), Bag(sparse=True)
    with pytest.raises(ValueError, match=r"'tokens\.weight' of model 1 "):
        amp.initialize([dense, sparse], verbosity=0)


@pytest.mark.parametrize("level", LEVELS)
def test_the_fix_trains_sparse_false(level):
    model = Bag(sparse=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    ids, target = _batch()
    losses = []
    for _ in range(20):
        loss = nn.functional.mse_loss(model(ids), target)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_a_frozen_sparse_embedding_is_accepted():
    """No gradient, nothing sparse to unscale: only the head trains."""
    model = Bag(sparse=True)
    model.tokens.weight.requires_grad_(False)
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    ids, target = _batch()
    loss = nn.functional.mse_loss(model(ids), target)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert model.tokens.weight.grad is None and model.head.weight.grad is not None
