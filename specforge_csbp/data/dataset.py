"""What one CSBP rank of a drafter run reads per sample: all tokens, and the context rows of its shard.

The sequence is padded up to a multiple of the block size S (ZigzagShards cuts on block boundaries), then
rank r of P takes its zigzag intervals:

    L = 10 tokens, S = 4  ->  seq_len = 12, B = 3 blocks, P = 2
    tokens     t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 -- --        (-- padding: pad id, loss 0, zero rows)
    rank 0     ...........   ...........   t8 t9 -- --        intervals [(8, 12)]
    rank 1     t0 t1 t2 t3   t4 t5 t6 t7                      intervals [(0, 8)]

Padding never changes the loss: a padded position is after every token, so no anchor's context (positions
before the anchor) contains it, and its loss mask is 0 so it is never an anchor or a target.

Every rank of one CP group must visit samples in the same order; use the same index sequence on all of
them (e.g. `DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, seed=s)` over data-parallel
replicas only), and `DataLoader(ds, batch_size=None)` since a long-context step is one sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..layout.zigzag import ZigzagShards
from .store import FeatureStore

__all__ = ["ShardedFeatureDataset", "ShardedSample"]


@dataclass
class ShardedSample:
    sample_id: str
    length: int  # real tokens L
    seq_len: int  # L rounded up to a multiple of block_size (ZigzagShards' seq_len)
    input_ids: torch.Tensor  # [seq_len] int64, pad_token_id after L
    loss_mask: torch.Tensor  # [seq_len] int64, 0 after L
    intervals: list[tuple[int, int]]  # this rank's zigzag token intervals in [0, seq_len)
    positions: torch.Tensor  # [n_local] int64, the positions of hidden_states' rows
    hidden_states: torch.Tensor  # [n_local, W] store dtype, zero rows at positions >= L


class ShardedFeatureDataset(torch.utils.data.Dataset):
    """Map-style dataset over a FeatureStore for rank `rank` of a `world_size`-rank CSBP/CP group.

    Reads per item: the sample's input_ids and loss_mask (whole) and the hidden-state rows of this rank's
    zigzag intervals only (`FeatureStore.read_intervals`). world_size = 1 reads the whole sequence.
    """

    def __init__(
        self,
        store: FeatureStore,
        *,
        rank: int,
        world_size: int,
        block_size: int,
        sample_ids: Sequence[str] | None = None,
        pad_token_id: int = 0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.store = store
        self.rank, self.world_size, self.block_size = rank, world_size, block_size
        self.pad_token_id = pad_token_id
        self.sample_ids = list(store.sample_ids if sample_ids is None else sample_ids)
        for sid in self.sample_ids:
            store.entry(sid)  # unknown ids fail now, not mid-epoch

    def __len__(self) -> int:
        return len(self.sample_ids)

    def shards(self, sample_id: str) -> ZigzagShards:
        length = self.store.length(sample_id)
        seq_len = -(-length // self.block_size) * self.block_size
        return ZigzagShards(seq_len, self.block_size, self.world_size)

    def __getitem__(self, index: int) -> ShardedSample:
        sid = self.sample_ids[index]
        length = self.store.length(sid)
        shards = self.shards(sid)
        seq_len = shards.seq_len
        intervals = shards.rank_intervals(self.rank)
        ids, mask = self.store.read_tokens(sid)
        input_ids = torch.full((seq_len,), self.pad_token_id, dtype=torch.int64)
        loss_mask = torch.zeros(seq_len, dtype=torch.int64)
        input_ids[:length], loss_mask[:length] = ids, mask
        # Padding is [length, seq_len), shorter than one block, so it lies inside the last block, which is
        # the tail of this rank's last interval if it is this rank's at all: read the real rows, append zeros.
        real = [(lo, min(hi, length)) for lo, hi in intervals]
        hidden = self.store.read_intervals(sid, real)
        n_pad = sum(hi - lo for lo, hi in intervals) - hidden.shape[0]
        if n_pad:
            hidden = torch.cat([hidden, hidden.new_zeros(n_pad, hidden.shape[1])])
        return ShardedSample(
            sample_id=sid, length=length, seq_len=seq_len, input_ids=input_ids, loss_mask=loss_mask,
            intervals=intervals, positions=shards.rank_positions(self.rank), hidden_states=hidden,
        )  # fmt: skip
