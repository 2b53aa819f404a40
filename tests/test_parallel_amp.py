"""apex_lite.parallel under amp on 2 gloo ranks (tests/workers/parallel_worker.py --suite amp, run
once for the module): DistributedDataParallel wrapped after amp.initialize keeps the ranks
bitwise identical at O1 and O2, with SyncBatchNorm (kept fp32 at O2) and LARC too, also when
the ranks built their models from different seeds."""
import pytest
import torch

import parallel_ranks

pytestmark = pytest.mark.skipif(not parallel_ranks.AVAILABLE, reason=parallel_ranks.REASON)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return parallel_ranks.run_suite("amp", tmp_path_factory.mktemp("amp"))


def assert_ranks_identical(ranks, name):
    first, second = ranks[0][name], ranks[1][name]
    for key in ("params", "masters", "buffers"):
        assert len(first[key]) == len(second[key]) > 0 or key == "buffers"
        for i, (a, b) in enumerate(zip(first[key], second[key])):
            assert torch.equal(a, b), f"{name}: {key}[{i}] differs between the ranks"


@pytest.mark.parametrize("name", ["O1_seeded_apart", "O2_same_seed", "O1_syncbn",
                                  "O2_syncbn_larc"])
def test_ranks_stay_bitwise_identical(ranks, name):
    assert_ranks_identical(ranks, name)


def test_O2_ranks_seeded_apart_stay_identical(ranks):
    """DDP's broadcast reaches the O2 masters too (apex_lite.amp.ddp.broadcast_masters)."""
    assert_ranks_identical(ranks, "O2_seeded_apart")


def test_the_levels_really_ran(ranks):
    """The half model at O2 (SyncBatchNorm kept fp32, as BatchNorm), fp32 at O1."""
    o2 = ranks[0]["O2_syncbn_larc"]
    assert o2["bn_type"] == "SyncBatchNorm" and o2["bn_weight_dtype"] == "torch.float32"
    assert o2["dtypes"][0] == "torch.bfloat16"
    assert all(m.dtype == torch.float32 for m in o2["masters"])
    assert set(ranks[0]["O1_syncbn"]["dtypes"]) == {"torch.float32"}
